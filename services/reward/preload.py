"""Imported once by the fork server that reward workers are forked from: whatever it loads here every worker
starts with, shared copy-on-write. A fresh worker would otherwise pay for it on its first requests (the
first math-verify call builds its parsers, about 0.1 s; the task sets that ground truth comes from)."""

from __future__ import annotations

import contextlib

from loom.envs import registry
from loom.rewards.math_reward import math_score
from services.reward import worker  # noqa: F401  (the workers' entry point, imported with its dependencies)


def _warm() -> None:
    math_score("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5")
    for env, sets in registry.DATASETS.items():
        for name in sets:
            # A missing data set only means its rewards will load (and fail) on demand.
            with contextlib.suppress(OSError, KeyError, ValueError):
                registry.task_ids(env, name, None)


_warm()

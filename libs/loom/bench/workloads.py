"""Trajectory lengths and worker profiles for the policy benchmarks, from the real traces."""

from __future__ import annotations

import numpy as np

from loom.data.traces import load_traces
from loom.policies.partition import WorkerProfile
from loom.policies.profiles import placement_profile
from loom.workloads.coding import TOOL_MEAN_S


def swe_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` total output lengths drawn (with replacement) from the 400 recorded SWE-bench trajectories."""
    totals = np.array([t.total_completion_tokens for t in load_traces().values()], dtype=np.float64)
    return np.random.default_rng(seed).choice(totals, size=n, replace=True)


def profile(
    model: str, gpu: str, tp: int, n: int, context_len: int = 16_384, max_running: int = 256
) -> WorkerProfile:
    return placement_profile(
        model,
        gpu,
        tp,
        context_len=context_len,
        max_running=max_running,
        tool_s=TOOL_MEAN_S,
        max_group=n,
        simulated=True,
    )

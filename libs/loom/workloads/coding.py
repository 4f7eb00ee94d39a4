"""Coding: the SWE-bench Verified agent trajectories (mini-swe-agent, Gemini 3 Pro).

Each call's context and output are the provider's recorded token counts. The traces hold one run per task;
by default the samples of a group are variations of it (``loom.workloads.siblings``), with ``siblings=
"replay"`` they replay it exactly (identical lengths: the figures before the variation model). Tool times
are drawn log-normal with the coding agent's mean tool time (Heddle Table 1: 0.41-0.46 s per call).
"""

from __future__ import annotations

import random
from pathlib import Path

from loom.data.traces import load_traces
from loom.workloads.base import Workload, WorkStep, WorkTraj, cap_output, lognormal, replay
from loom.workloads.siblings import vary

TOOL_MEAN_S = 0.43
TOOL_SIGMA = 0.8
SIBLINGS = ("varied", "replay")


def coding(
    prompts: int | None = None,
    group_size: int = 16,
    seed: int = 0,
    path: str | Path | None = None,
    siblings: str = "varied",
) -> Workload:
    if siblings not in SIBLINGS:
        raise ValueError(f"unknown siblings {siblings!r}; one of {SIBLINGS}")
    traces = list(load_traces(path).values())[:prompts]
    rng = random.Random(seed)
    variation = random.Random(f"siblings:{seed}")
    w = Workload("coding", __doc__ or "")
    for trace in traces:
        for s in range(group_size):
            tid = f"{trace.id}#{s}"
            if siblings == "replay":
                w.trajectories.append(
                    replay(
                        tid,
                        trace.id,
                        s,
                        trace,
                        lambda _: lognormal(rng, TOOL_MEAN_S, TOOL_SIGMA),
                        lambda _: TOOL_MEAN_S,
                    )
                )
                continue
            calls = vary(trace.steps, variation)
            steps = cap_output(
                [WorkStep(i, o, lognormal(rng, TOOL_MEAN_S, TOOL_SIGMA), TOOL_MEAN_S) for _, i, o in calls]
            )
            origin = tuple(c[0] for c in calls[: len(steps)])
            reward = 1.0 if trace.resolved else 0.0
            w.trajectories.append(WorkTraj(tid, trace.id, s, steps, reward, trace=trace.id, origin=origin))
    return w

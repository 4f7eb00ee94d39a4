"""Coding: the SWE-bench Verified agent trajectories (mini-swe-agent, Gemini 3 Pro).

Each call's context and output are the provider's recorded token counts. The traces hold one run per
task, so the samples of a group replay that run; they differ in their tool times, drawn log-normal with
the coding agent's mean tool time (Heddle Table 1: 0.41-0.46 s per call).
"""

from __future__ import annotations

import random
from pathlib import Path

from loom.traces import load_traces
from loom.workloads.base import Workload, WorkStep, WorkTraj, cap_output, lognormal

TOOL_MEAN_S = 0.43
TOOL_SIGMA = 0.8


def coding(
    prompts: int | None = None, group_size: int = 16, seed: int = 0, path: str | Path | None = None
) -> Workload:
    traces = list(load_traces(path).values())[:prompts]
    rng = random.Random(seed)
    w = Workload("coding", __doc__ or "")
    for trace in traces:
        for s in range(group_size):
            steps = [
                WorkStep(st.prompt_tokens, st.completion_tokens, lognormal(rng, TOOL_MEAN_S, TOOL_SIGMA))
                for st in trace.steps
            ]
            reward = 1.0 if trace.resolved else 0.0
            w.trajectories.append(WorkTraj(f"{trace.id}#{s}", trace.id, s, cap_output(steps), reward))
    return w

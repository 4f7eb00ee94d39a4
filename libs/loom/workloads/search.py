"""Search: ReAct agents on HotpotQA (100 questions x 5 trials, Reflexion's logs; ``loom.data.trace_sets``).

The trials of a question are the samples of its group: real runs of the same prompt, though the logged agent
was nearly deterministic, so only 26 of the 100 groups differ between trials. Groups larger than the 5 trials
(GRPO's 16) replay the trials in turn, each replay with its own tool times. Tool time is the search agent's
(Heddle Table 1: 1.41-1.43 s per call).
"""

from __future__ import annotations

import random
from pathlib import Path

from loom.data.trace_sets import search_traces
from loom.workloads.base import Workload, group_traces, lognormal, replay

TOOL_MEAN_S = 1.42
TOOL_SIGMA = 0.5


def search(
    prompts: int | None = None, group_size: int = 5, seed: int = 0, path: str | Path | None = None
) -> Workload:
    rng = random.Random(seed)
    w = Workload("search", __doc__ or "")
    for prompt, trials in list(group_traces(search_traces(path)).items())[:prompts]:
        for s in range(group_size):
            trace = trials[s % len(trials)]
            w.trajectories.append(
                replay(
                    f"q{len(w.trajectories)}",
                    prompt,
                    s,
                    trace,
                    lambda _: lognormal(rng, TOOL_MEAN_S, TOOL_SIGMA),
                    lambda _: TOOL_MEAN_S,
                )
            )
    return w

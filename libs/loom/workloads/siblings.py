"""Samples of one prompt that differ: within-group variation for a trace set with one run per task.

The SWE traces hold one run per task, so the 16 samples of a GRPO group would replay it 16 times, with
identical lengths, which real groups sampled at temperature 1.0 do not have (Heddle §4.1, Figure 5: a sibling
that fails a test takes rectification steps the other does not). Each sample here is a variation of the
recorded run: its number of calls and its tokens per call are the recorded ones times two log-normal factors
with mean 1, correlated, whose spreads are the within-group spreads of the traces that do hold several
trials per task:

- tau-bench airline (4 trials of 40 tasks): sigma of log calls 0.334, of log tokens per call 0.239, of log
  total 0.458 (so a correlation of 0.26 between the two); the longest of a group's 4 trials is 2.3x its
  shortest at the median, 4.8x at p90;
- HotpotQA ReAct (5 trials of 100 questions): 0.060, 0.037 and 0.070. Its agent decoded greedily, so its
  trials barely differ; tau-bench's agent did too, but its simulated user is itself sampled, which is the
  variation an agent sampled at temperature 1.0 meets at the very least. The model takes tau-bench's.

A sample with fewer calls than the recorded run keeps its first calls and the final one (the submission); one
with more repeats calls from the second half of the run (the edit-and-test cycle) before the final one. Each
call's context grows by the sample's own output and the observation the recorded call got back. ``origin``
names the recorded call each call replays, so a predictor can read the recorded text.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import numpy as np

from loom.data.traces import TraceStep
from loom.workloads.base import Workload

SIGMA_CALLS = 0.334
SIGMA_PER_CALL = 0.239
RHO = 0.26


def vary(steps: Sequence[TraceStep], rng: random.Random) -> list[tuple[int, int, int]]:
    """One sample's calls as ``(origin, input_len, output_len)``."""
    n = len(steps)
    if not n:
        return []
    z1, z2 = rng.gauss(0.0, 1.0), rng.gauss(0.0, 1.0)
    calls = math.exp(SIGMA_CALLS * z1 - SIGMA_CALLS**2 / 2)
    per_call = math.exp(SIGMA_PER_CALL * (RHO * z1 + math.sqrt(1 - RHO**2) * z2) - SIGMA_PER_CALL**2 / 2)
    m = max(1, round(n * calls))
    if m <= n:
        origin = [*range(m - 1), n - 1]
    else:
        cycle = range(n // 2, n - 1) if n > 2 else range(max(1, n - 1))
        extra = sorted(rng.choice(cycle) for _ in range(m - n))
        origin = [*range(n - 1), *extra, n - 1]
        origin.sort(key=lambda i: (i == n - 1, i))  # repeats stay in their place in the cycle
    observed = [
        max(0, b.prompt_tokens - a.prompt_tokens - a.completion_tokens) for a, b in itertools.pairwise(steps)
    ]
    out, context = [], steps[0].prompt_tokens
    for i in origin:
        k = max(1, round(steps[i].completion_tokens * per_call))
        out.append((i, context, k))
        context += k + (observed[i] if i < n - 1 else 0)
    return out


def within_group_sigmas(w: Workload) -> dict[str, float]:
    """Standard deviations of log total output, log calls and log output per call about each group's mean
    (the unbiased pooled estimate): how much the samples of one prompt differ."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for t in w.trajectories:
        groups.setdefault(t.prompt, []).append((float(t.output_tokens), float(len(t.steps))))
    dev: dict[str, list[float]] = {"total": [], "calls": [], "per_call": []}
    dof = 0
    for g in groups.values():
        if len(g) < 2:
            continue
        tot, calls = np.log([x for x, _ in g]), np.log([c for _, c in g])
        for key, v in (("total", tot), ("calls", calls), ("per_call", tot - calls)):
            dev[key].extend(v - v.mean())
        dof += len(g) - 1
    if not dof:
        raise ValueError("no group has two samples")
    return {k: round(math.sqrt(float(np.sum(np.square(v))) / dof), 3) for k, v in dev.items()}

"""How well a predictor orders the trajectories of one batch, where a scheduler uses it: Kendall's tau-b
between predicted and actual total lengths, among the trajectories of a batch still running after k calls.

Heddle ranks a batch's trajectories at admission and re-ranks them as they go; what matters is the order
within a batch, not the error of a length. Beside Loom's learned model (cross-fitted: every prompt predicted
by the model of the fold that never saw it) stand the free heuristics a rollout system has without one:

- ``prompt_length``: the longer prompt runs longer;
- ``previous_epoch``: the prompt's sample of the previous epoch (another recorded run of the same prompt);
- ``first_sibling``: the total of the group's first sample to finish, once one has (before that, nothing);
- ``served``: the learned model refined by the group's finished samples (``loom.predict.blend``), as the
  predictor service serves it.

A sibling counts as finished at step k when it made at most k calls: the samples of a group start together
and their calls take about as long, so one that stopped sooner is done before the others' next call.
Every token-length estimate is at least what the trajectory has generated so far.

A batch is ``BATCH_PROMPTS`` consecutive prompts of the workload with all their samples; the figure is the
mean tau-b over batches, with a 95% bootstrap interval over batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.predict.blend import SiblingBlend
from loom.workloads.base import Workload, WorkTraj

STEPS = (0, 1, 2, 5)
BATCH_PROMPTS = 8
METHODS = ("learned", "served", "first_sibling", "previous_epoch", "prompt_length")


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b (ties in either variable corrected for); 0 where either side is constant."""
    a, b = np.asarray(x, float), np.asarray(y, float)
    if len(a) != len(b):
        raise ValueError("x and y must be of one length")
    if len(a) < 2:
        return 0.0
    iu = np.triu_indices(len(a), k=1)
    dx = np.sign(a[:, None] - a[None, :])[iu]
    dy = np.sign(b[:, None] - b[None, :])[iu]
    pairs = len(dx)
    untied_x, untied_y = pairs - np.count_nonzero(dx == 0), pairs - np.count_nonzero(dy == 0)
    if untied_x == 0 or untied_y == 0:
        return 0.0
    return float(np.sum(dx * dy) / np.sqrt(float(untied_x) * float(untied_y)))


@dataclass(frozen=True)
class TauInterval:
    estimate: float
    low: float
    high: float
    batches: int
    trajectories: int


def _generated(t: WorkTraj, k: int) -> float:
    return float(sum(s.output_len for s in t.steps[:k]))


def _groups(workload: Workload) -> dict[str, list[WorkTraj]]:
    out: dict[str, list[WorkTraj]] = {}
    for t in workload.trajectories:
        out.setdefault(t.prompt, []).append(t)
    return out


def scores(
    workload: Workload, k: int, learned: dict[str, np.ndarray], model_log_sd: float
) -> dict[str, dict[str, float]]:
    """Each method's score for every trajectory still running after ``k`` calls (id -> score)."""
    groups = _groups(workload)
    out: dict[str, dict[str, float]] = {m: {} for m in METHODS}
    blend = SiblingBlend(model_log_sd)
    first_done: dict[str, WorkTraj | None] = {}
    for prompt, samples in groups.items():
        finished = sorted(
            (s for s in samples if len(s.steps) <= k), key=lambda s: (len(s.steps), s.output_tokens)
        )
        first_done[prompt] = finished[0] if finished else None
        for s in finished:
            blend.observe(prompt, s.output_tokens, float(learned[s.id][0]))
    for prompt, samples in groups.items():
        first = first_done[prompt]
        for i, t in enumerate(samples):
            if len(t.steps) <= k:
                continue
            g = _generated(t, k)
            model = float(learned[t.id][k])
            previous = samples[(i + 1) % len(samples)] if len(samples) > 1 else None
            out["learned"][t.id] = max(model, g)
            out["served"][t.id] = blend.total(prompt, model, g)
            out["first_sibling"][t.id] = max(float(first.output_tokens), g) if first is not None else g
            out["previous_epoch"][t.id] = max(float(previous.output_tokens), g) if previous else g
            out["prompt_length"][t.id] = float(t.steps[0].input_len)
    return out


def within_batches(
    workload: Workload,
    by_method: dict[str, dict[str, float]],
    batch_prompts: int = BATCH_PROMPTS,
    samples: int = 2000,
    seed: int = 0,
) -> dict[str, TauInterval]:
    """Each method's mean tau-b over batches of ``batch_prompts`` prompts, with a bootstrap interval."""
    prompts = list(_groups(workload))
    actual = {t.id: float(t.output_tokens) for t in workload.trajectories}
    prompt_of = {t.id: t.prompt for t in workload.trajectories}
    batches = [set(prompts[i : i + batch_prompts]) for i in range(0, len(prompts), batch_prompts)]
    rng = np.random.default_rng(seed)
    out: dict[str, TauInterval] = {}
    for method, score in by_method.items():
        taus = []
        for batch in batches:
            ids = [i for i in score if prompt_of[i] in batch]
            if len(ids) >= 2:
                taus.append(kendall_tau_b([score[i] for i in ids], [actual[i] for i in ids]))
        if not taus:
            continue
        v = np.asarray(taus)
        means = v[rng.integers(0, len(v), (samples, len(v)))].mean(axis=1)
        low, high = np.percentile(means, [2.5, 97.5])
        out[method] = TauInterval(float(v.mean()), float(low), float(high), len(v), len(score))
    return out


def ranking_report(
    workload: Workload,
    learned: dict[str, np.ndarray],
    model_log_sd: float,
    steps: Sequence[int] = STEPS,
) -> dict[str, dict[str, dict[str, object]]]:
    """step -> method -> {tau, ci95, batches, trajectories}, for the steps some trajectories reach."""
    report: dict[str, dict[str, dict[str, object]]] = {}
    for k in steps:
        taus = within_batches(workload, scores(workload, k, learned, model_log_sd))
        if not taus:
            continue
        report[f"step{k}"] = {
            m: {
                "tau": round(iv.estimate, 3),
                "ci95": [round(iv.low, 3), round(iv.high, 3)],
                "batches": iv.batches,
                "trajectories": iv.trajectories,
            }
            for m, iv in taus.items()
        }
    return report

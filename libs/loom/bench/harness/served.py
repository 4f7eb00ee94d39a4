"""The predictor Loom serves, in the harness: the combiner (``loom.predict.combine``) over the text model's
cross-fitted estimates, itself cross-fitted by prompt.

Its training rows are the three trace sets as ``loom bench predictor`` ranks them (``GROUP`` samples a
prompt), at ``ROW_STEPS``, each row what a rollout knows of a trajectory at that step (``known_at``). Fold
f's combiner is fitted on the rows of every prompt outside the text model's fold f, so a trajectory is served
by a text model and a combiner that never saw its prompt. The combiners are cached beside the fold models.

In a row, the prompt's other samples stand for its earlier epoch: each sample's history is the others, the
latest of them the one the ``previous_epoch`` heuristic takes. A sibling counts as finished at step k when it
made at most k calls: the samples of a group start together and their calls take about as long, so one
that stopped sooner is done before the others' next call; a running sibling has generated what its first k
calls did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import numpy as np

from loom.bench.harness.learned import Budget, Learned, cache_root, cross_fitted, fold_of, totals_by
from loom.data.traces import prompt_id
from loom.predict import combine
from loom.predict.combine import Known, Row
from loom.workloads import WORKLOADS
from loom.workloads.base import Workload, WorkTraj
from loom.workloads.recorded import Recorded

# Samples per prompt, per workload: the benchmarks' groups (search and tool use hold 5 and 4 recorded trials).
GROUP = {"coding": 16, "search": 5, "tool_use": 4}
# Prompts of each trace set ranked and trained on (None: all); coding's trajectories are long, its rows many.
ROW_PROMPTS: dict[str, int | None] = {"coding": 64, "search": None, "tool_use": None}
QUICK_ROW_PROMPTS: dict[str, int | None] = {"coding": 4, "search": 12, "tool_use": 6}
# Where rows are taken: the early steps each, then sparser (coding runs to a hundred calls).
ROW_STEPS = (0, 1, 2, 3, 5, 8, 12, 20, 30, 50)
BATCH_PROMPTS = 8
VERSION = 5


def row_workloads(prompts: Mapping[str, int | None], seed: int) -> dict[str, Workload]:
    """The trace sets as the benchmarks replay them (coding's samples vary its recorded run, its default)."""
    return {
        name: WORKLOADS[name](prompts=n, group_size=GROUP[name], seed=seed) for name, n in prompts.items()
    }


def _generated(t: WorkTraj, k: int) -> float:
    return float(sum(s.output_len for s in t.steps[:k]))


def prompt_key(t: WorkTraj) -> str:
    """The prompt as the text model's folds deal it (a recorded run's id up to ``#trial``)."""
    return prompt_id(t.trace) if t.trace else t.prompt


def known_at(workload: Workload, k: int, learned: Mapping[str, np.ndarray]) -> dict[str, Known]:
    """What a rollout knows of every trajectory still running after ``k`` calls (id -> Known)."""
    out: dict[str, Known] = {}
    for samples in workload.by_prompt().values():
        n = len(samples)
        finished = sorted(
            (s for s in samples if len(s.steps) <= k), key=lambda s: (len(s.steps), s.output_tokens)
        )
        for i, t in enumerate(samples):
            if len(t.steps) <= k:
                continue
            model = float(learned[t.id][k]) if t.id in learned else float("nan")
            out[t.id] = Known(
                step=k,
                generated=_generated(t, k),
                prompt_len=float(t.steps[0].input_len),
                model_total=None if np.isnan(model) else model,
                # Oldest first: the last is the sample ``previous_epoch`` takes.
                history=tuple(float(samples[(i + j) % n].output_tokens) for j in range(n - 1, 0, -1)),
                finished=tuple(float(s.output_tokens) for s in finished),
                running=tuple((k, _generated(s, k)) for s in samples if s is not t and len(s.steps) > k),
                workload=t.task or workload.name,
            )
    return out


def rows(workload: Workload, learned: Mapping[str, np.ndarray], steps: Sequence[int]) -> list[Row]:
    """Every trajectory at every step of ``steps`` it is still running at, ranked within its batch of
    ``BATCH_PROMPTS`` prompts at that step."""
    batch_of = {p: i // BATCH_PROMPTS for i, p in enumerate(workload.by_prompt())}
    by_id = {t.id: t for t in workload.trajectories}
    out = []
    for k in steps:
        for tid, known in known_at(workload, k, learned).items():
            t = by_id[tid]
            batch = f"{workload.name}:{k}:{batch_of[t.prompt]}"
            out.append(Row(known, float(t.output_tokens), prompt_key(t), batch, tid))
    return out


def training_rows(
    budget: Budget, prompts: Mapping[str, int | None], log: Callable[[str], None] | None = None
) -> dict[str, list[Row]]:
    """workload -> its rows, the text model's estimates cross-fitted under ``budget``."""
    out = {}
    for name, w in row_workloads(prompts, budget.seed).items():
        out[name] = rows(w, cross_fitted(w, budget, log, steps=ROW_STEPS).totals, ROW_STEPS)
    return out


def combiner_folds(budget: Budget, prompts: Mapping[str, int | None]) -> dict[str, int]:
    """prompt key -> its combiner's fold: its batch's (``BATCH_PROMPTS`` consecutive prompts of a trace set),
    so that a batch is ranked by one combiner that never saw its prompts, as one served model ranks a batch
    (by each prompt's own fold, a batch mixed five combiners, whose estimates of two prompts differ by more
    than their ranking). A trace set's batches are dealt round the folds, so each fold's combiner trains on
    some of every set; one with fewer batches than folds deals its prompts instead."""
    out = {}
    for name, w in row_workloads(prompts, budget.seed).items():
        keys = [prompt_key(samples[0]) for samples in w.by_prompt().values()]
        start = fold_of(name, budget.folds, budget.seed)
        per_batch = -(-len(keys) // BATCH_PROMPTS) >= budget.folds
        for i, key in enumerate(keys):
            out[key] = (
                (start + i // BATCH_PROMPTS) % budget.folds
                if per_batch
                else fold_of(key, budget.folds, budget.seed)
            )
    return out


def fold_combiners(
    budget: Budget, prompts: Mapping[str, int | None], log: Callable[[str], None] | None = None
) -> list[combine.Combiner]:
    """Fold f's combiner, fitted on the rows of the prompts outside combiner fold f (``combiner_folds``);
    cached beside the fold models."""
    key = hashlib.sha1(f"{VERSION}:{sorted(prompts.items(), key=str)}:{ROW_STEPS}".encode())
    # The combiner's code and this module's (which rows, which folds) are in the key: a cached combiner fitted
    # under other folds would serve prompts it saw.
    for source in (combine.__file__, __file__):
        with open(source, "rb") as f:
            key.update(f.read())
    path = cache_root() / budget.key() / f"combiners-{key.hexdigest()[:16]}.json"
    if path.exists():
        return [combine.Combiner.from_json(d) for d in json.loads(path.read_text())]
    pooled = [r for rs in training_rows(budget, prompts, log).values() for r in rs]
    fold = combiner_folds(budget, prompts)
    models = [
        combine.fit([r for r in pooled if fold[r.prompt] != f], budget.seed) for f in range(budget.folds)
    ]
    # Measured at admission on each fold's own prompts, by the combiner that never saw them.
    first = combine.first_epoch(pooled)
    admission = combine.admission_fit([models[fold[r.prompt]].total(r.known) for r in first], first)
    for m in models:
        m.admission = admission
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([m.to_json() for m in models]))
    tmp.replace(path)
    return models


def served(
    workload: Workload,
    budget: Budget,
    prompts: Mapping[str, int | None] = ROW_PROMPTS,
    log: Callable[[str], None] | None = None,
) -> Learned:
    """The workload's text-model estimates (cross-fitted) with the fold combiners that serve them, and their
    error at admission as a first epoch knows it (``combine.admission_fit``)."""
    return _with_combiners(cross_fitted(workload, budget, log), budget, prompts, log, workload.name)


def for_file(
    rec: Recorded,
    workload: Workload,
    budget: Budget,
    prompts: Mapping[str, int | None] = ROW_PROMPTS,
    log: Callable[[str], None] | None = None,
) -> tuple[Learned, str]:
    """What the predictor serves ``workload``, a batch (or every step) of the rollout-trace file ``rec``, and
    what the report calls it: where the file has text, the text model reads it (each trajectory by the fold
    model that never saw its prompt, as on the trace sets: a built-in set written out is served as it is
    built in) under the fold combiners; where it has lengths alone, what they allow (``lengths_only``)."""
    if not rec.has_text:
        return lengths_only(budget, prompts, log), "learned (lengths only)"
    # Its error at admission is that of the workload its trajectories name, where they name one (a built-in
    # set written out), else the pooled error of a workload the combiners never saw.
    tasks = {t.task or workload.name for t in workload.trajectories}
    name = tasks.pop() if len(tasks) == 1 else workload.name
    text = cross_fitted(workload, budget, log, traces=rec.traces)
    return _with_combiners(text, budget, prompts, log, name), "learned"


def lengths_only(
    budget: Budget, prompts: Mapping[str, int | None] = ROW_PROMPTS, log: Callable[[str], None] | None = None
) -> Learned:
    """What the predictor serves a workload with no text (a rollout log of lengths alone): the fold combiners
    without the text model, each prompt's estimate from its history, siblings and step (their no-text
    regimes), trusted at admission as far as on a workload none of them saw (``Combiner.trust``)."""
    return _with_combiners(Learned({}, 0.0), budget, prompts, log)


def _with_combiners(
    text: Learned,
    budget: Budget,
    prompts: Mapping[str, int | None],
    log: Callable[[str], None] | None,
    workload: str = "",
) -> Learned:
    """``text`` served through the fold combiners, with their error at admission on ``workload``."""
    models = tuple(fold_combiners(budget, prompts, log))
    sd, slope = models[0].trust(workload)
    return dataclasses.replace(
        text,
        admission_log_sd=sd,
        admission_slope=slope,
        combiners=models,
        folds=budget.folds,
        seed=budget.seed,
        combiner_fold=combiner_folds(budget, prompts),
    )


def fit_for_model(
    model: Any, held_out: Set[str], prompts: Mapping[str, int | None] = ROW_PROMPTS, seed: int = 0
) -> combine.Combiner:
    """The combiner for one exported text model (an ``OnnxRegressor``), fitted on the rows of the prompts
    it never saw (``held_out``): what ``loom predictor train`` writes beside the model it trained."""
    out: list[Row] = []
    for w in row_workloads(prompts, seed).values():
        kept = Workload(w.name, w.source, [t for t in w.trajectories if prompt_key(t) in held_out])
        if kept.trajectories:
            out += rows(kept, totals_by(kept, lambda _: model, ROW_STEPS), ROW_STEPS)
    if not out:
        raise ValueError("none of the held-out prompts is in the trace sets: no rows to fit a combiner on")
    # Its error at admission, on halves of the prompts, each predicted by a combiner fitted on the other.
    half = {r.prompt: zlib.crc32(f"half:{seed}:{r.prompt}".encode()) % 2 for r in out}
    halves = [[r for r in out if half[r.prompt] != h] for h in (0, 1)]
    fitted = [combine.fit(rs, seed) if rs else None for rs in halves]
    first, predicted = combine.first_epoch(out), []
    for r in first:
        other = fitted[half[r.prompt]]
        predicted.append(other.total(r.known) if other is not None else r.total)
    combiner = combine.fit(out, seed)
    combiner.admission = combine.admission_fit(predicted, first)
    return combiner

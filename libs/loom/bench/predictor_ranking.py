"""How well a predictor orders the trajectories of one batch, where a scheduler uses it: Kendall's tau-b
between predicted and actual total lengths, among the trajectories of a batch still running after k calls.

Heddle ranks a batch's trajectories at admission and re-ranks them as they go; what matters is the order
within a batch, not the error of a length. Beside the predictor Loom serves stand its text model alone and
the free heuristics a rollout system has without one:

- ``served``: the combiner (``loom.predict.combine``) over the text model, the prompt's earlier samples, the
  group's finished and running samples and the step, cross-fitted by prompt as the text model is (every
  prompt predicted by a combiner fitted without it);
- ``learned``: the text model's total alone (cross-fitted by prompt);
- ``previous_epoch``: the prompt's sample of the previous epoch (another recorded run of the same prompt);
- ``previous_mean``: the mean (of logs) of all of the prompt's earlier samples, the served model's history;
- ``first_sibling``: the total of the group's first sample to finish, once one has (before that, nothing);
- ``prompt_length``: the longer prompt runs longer.

What each method knows at step k is what ``loom.bench.harness.served.known_at`` says a rollout knows (the
prompt's other samples standing for its earlier epoch). Every token estimate is at least what the trajectory
has generated so far.

A batch is ``BATCH_PROMPTS`` consecutive prompts of the workload with all their samples; the figure is the
mean tau-b over batches, with a 95% bootstrap interval over batches. Beside tau, as Heddle reports them,
the recall of the top 10% and Pearson's r over all the workload's trajectories at that step; and the
served model's tau against the best free heuristic's at that step (``served_vs_best``: the text model is
not free), paired batch by batch.

Beside each tau, ``between_prompts``: tau-b over the batch's pairs of samples of different prompts alone
(``served_vs_best`` gives the served model's gain there, ``between_diff``). Within a prompt the history
heuristics' order is reversed by construction here: a sample's earlier samples are the other samples of its
group, so the longer of two siblings has the shorter others (a real previous epoch is one for the whole
group, and ties within it); and at admission nothing tells a prompt's samples apart. So at step 0 a gain over
a history heuristic within a prompt is this construction's, not a prediction's; between prompts it is real,
and ``prompt_bound`` (each trajectory scored by its prompt's own mean total) is what ranking prompts can reach.

``held_out``: the combiner fitted on two workloads and tested on the third (every rotation), against the
heuristics on that third: how it does on a workload it never saw.

``first_epoch``: every trajectory as a job's first epoch knows it, no earlier sample of its prompt (what a
``heddle-suite`` cell's predictor knows), against the free heuristics left there (the first sibling, the
prompt's length): the served predictor should degrade to the best of them, never below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from loom.bench import ranking_bound
from loom.bench.harness.learned import Budget, cross_fitted
from loom.bench.harness.served import (
    BATCH_PROMPTS,
    combiner_folds,
    fold_combiners,
    known_at,
    prompt_key,
    training_rows,
)
from loom.predict import combine, evaluate
from loom.predict.combine import Known
from loom.predict.evaluate import kendall_tau_b
from loom.workloads.base import Workload, WorkTraj

STEPS = (0, 1, 2, 5)
HEURISTICS = ("learned", "previous_epoch", "previous_mean", "first_sibling", "prompt_length")
METHODS = ("served", *HEURISTICS)
# What a rollout system has without a trained model: the bar the served predictor is held to.
FREE = tuple(m for m in HEURISTICS if m != "learned")
# What a first epoch does not know: its prompts' earlier samples, and so the heuristics read from them.
FIRST_EPOCH = ("history",)


@dataclass(frozen=True)
class TauInterval:
    estimate: float
    low: float
    high: float
    batches: int
    trajectories: int


def heuristic_scores(known: Mapping[str, Known]) -> dict[str, dict[str, float]]:
    """Each heuristic's score for every trajectory in ``known`` (id -> score)."""
    out: dict[str, dict[str, float]] = {m: {} for m in HEURISTICS}
    for tid, k in known.items():
        g = k.generated
        out["learned"][tid] = max(k.model_total or 0.0, g)
        out["previous_epoch"][tid] = max(k.history[-1], g) if k.history else g
        out["previous_mean"][tid] = (
            max(float(np.exp(np.mean(np.log(np.maximum(k.history, 1.0))))), g) if k.history else g
        )
        out["first_sibling"][tid] = max(k.finished[0], g) if k.finished else g
        out["prompt_length"][tid] = k.prompt_len
    return out


def cross_fitted_served(
    workloads: Mapping[str, Workload],
    learned: Mapping[str, Mapping[str, np.ndarray]],
    budget: Budget,
    prompts: Mapping[str, int | None],
    steps: Sequence[int] = STEPS,
    drop: Sequence[str] = (),
) -> dict[str, dict[int, dict[str, float]]]:
    """workload -> step -> id -> the served total, each prompt's by the combiner of its batch's fold (fitted
    on the rows of every other fold's prompts, of all the workloads); ``drop``: groups of knowledge it is
    served without (``FIRST_EPOCH``)."""
    models = fold_combiners(budget, prompts)
    fold = combiner_folds(budget, prompts)
    return {
        name: _served(w, learned[name], steps, lambda t: models[fold[prompt_key(t)]], drop)
        for name, w in workloads.items()
    }


def held_out_served(
    workloads: Mapping[str, Workload],
    learned: Mapping[str, Mapping[str, np.ndarray]],
    budget: Budget,
    prompts: Mapping[str, int | None],
    steps: Sequence[int] = STEPS,
) -> tuple[dict[str, dict[int, dict[str, float]]], dict[str, dict[str, np.ndarray]]]:
    """workload -> step -> id -> the served total on a workload the predictor was not trained on, and the
    text model's totals there (workload -> id -> per step): the text
    model trained on the other trace sets alone, the combiner fitted on the other workloads' rows alone (their
    text estimates cross-fitted by prompt, as in service)."""
    train = training_rows(budget, prompts)
    out, texts = {}, {}
    for name, w in workloads.items():
        text = cross_fitted(w, dataclasses.replace(budget, folds=1, held_out=name), steps=steps).totals
        model = combine.fit([r for other, rs in train.items() if other != name for r in rs], budget.seed)

        def every(_: WorkTraj, m: combine.Combiner = model) -> combine.Combiner:
            return m

        out[name] = _served(w, text, steps, every)
        texts[name] = text
    return out, texts


def _served(
    w: Workload,
    text: Mapping[str, np.ndarray],
    steps: Sequence[int],
    model_of: Callable[[WorkTraj], combine.Combiner],
    drop: Sequence[str] = (),
) -> dict[int, dict[str, float]]:
    """step -> id -> the served total of each trajectory still running, by the combiner ``model_of`` it."""
    by_id = {t.id: t for t in w.trajectories}
    return {
        k: {
            tid: model_of(by_id[tid]).total(combine.masked(known, drop))
            for tid, known in known_at(w, k, text).items()
        }
        for k in steps
    }


def within_batches(
    workload: Workload,
    by_method: Mapping[str, Mapping[str, float]],
    batch_prompts: int = BATCH_PROMPTS,
    samples: int = 2000,
    seed: int = 0,
) -> dict[str, TauInterval]:
    """Each method's mean tau-b over batches of ``batch_prompts`` prompts, with a bootstrap interval."""
    per_batch = batch_taus(workload, by_method, batch_prompts)
    rng = np.random.default_rng(seed)
    out: dict[str, TauInterval] = {}
    for method, taus in per_batch.items():
        if not taus:
            continue
        v = np.asarray(taus)
        means = v[rng.integers(0, len(v), (samples, len(v)))].mean(axis=1)
        low, high = np.percentile(means, [2.5, 97.5])
        out[method] = TauInterval(float(v.mean()), float(low), float(high), len(v), len(by_method[method]))
    return out


def batch_taus(
    workload: Workload,
    by_method: Mapping[str, Mapping[str, float]],
    batch_prompts: int = BATCH_PROMPTS,
    between: bool = False,
) -> dict[str, list[float]]:
    """Each method's tau-b in every batch with two or more of its trajectories scored (one list per
    method, batch by batch in the workload's order: paired across methods); ``between``: over the pairs of
    different prompts alone (``between_prompts``)."""
    prompts = list(workload.by_prompt())
    actual = {t.id: float(t.output_tokens) for t in workload.trajectories}
    prompt_of = {t.id: t.prompt for t in workload.trajectories}
    batches = [set(prompts[i : i + batch_prompts]) for i in range(0, len(prompts), batch_prompts)]
    out: dict[str, list[float]] = {}
    for method, score in by_method.items():
        taus = out.setdefault(method, [])
        for batch in batches:
            ids = [i for i in score if prompt_of[i] in batch]
            if len(ids) >= 2 and (not between or len({prompt_of[i] for i in ids}) >= 2):
                groups = [prompt_of[i] for i in ids] if between else None
                taus.append(kendall_tau_b([score[i] for i in ids], [actual[i] for i in ids], groups))
    return out


def _paired(
    ours: Sequence[float], theirs: Sequence[float], samples: int = 2000, seed: int = 0
) -> dict[str, object]:
    gain = np.asarray(ours) - np.asarray(theirs)
    rng = np.random.default_rng(seed)
    means = gain[rng.integers(0, len(gain), (samples, len(gain)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {
        "diff": round(float(gain.mean()), 3),
        "ci95": [round(float(low), 3), round(float(high), 3)],
        "p_better": round(float(np.mean(means > 0)), 3),
    }


def step_report(
    workload: Workload, by_method: Mapping[str, Mapping[str, float]], bootstrap_samples: int = 500
) -> dict[str, object]:
    """One step's figures: per method tau (interval), recall of the top 10% and Pearson's r (intervals,
    over the trajectories), and the served model against the best heuristic, paired by batch."""
    actual_of = {t.id: float(t.output_tokens) for t in workload.trajectories}
    taus = within_batches(workload, by_method)
    per_batch = batch_taus(workload, by_method)
    apart = batch_taus(workload, by_method, between=True)
    out: dict[str, object] = {}
    for m, iv in taus.items():
        ids = sorted(by_method[m])
        actual = [actual_of[i] for i in ids]
        predicted = [by_method[m][i] for i in ids]
        row: dict[str, object] = {
            "tau": round(iv.estimate, 3),
            "ci95": [round(iv.low, 3), round(iv.high, 3)],
            "batches": iv.batches,
            "trajectories": iv.trajectories,
        }
        if apart.get(m):
            row["between_prompts"] = round(float(np.mean(apart[m])), 3)
        if len(ids) >= 10:
            for name, metric in (("recall", evaluate.tail_recall), ("pearson", evaluate.pearson)):
                b = evaluate.bootstrap(metric, actual, predicted, samples=bootstrap_samples)
                row[name] = round(b.estimate, 3)
                row[f"{name}_ci95"] = [round(b.low, 3), round(b.high, 3)]
        out[m] = row
    heuristics = [m for m in taus if m in FREE]
    if "served" in taus and heuristics:
        best = max(heuristics, key=lambda m: taus[m].estimate)
        vs: dict[str, object] = {"best": best, **_paired(per_batch["served"], per_batch[best])}
        if apart.get("served") and apart.get(best):
            vs["between_diff"] = round(
                float(np.mean(np.asarray(apart["served"]) - np.asarray(apart[best]))), 3
            )
        out["served_vs_best"] = vs
    return out


def ranking_report(
    workload: Workload,
    learned: Mapping[str, np.ndarray],
    served: Mapping[int, Mapping[str, float]] | None = None,
    steps: Sequence[int] = STEPS,
    drop: Sequence[str] = (),
) -> dict[str, dict[str, object]]:
    """step -> method -> figures (and ``served_vs_best``), for the steps some trajectories reach; ``drop``:
    groups of knowledge nobody has (``FIRST_EPOCH``), and the heuristics read from them left out (the group
    each needs is the combiner's, ``combine.HEURISTICS``)."""
    report: dict[str, dict[str, object]] = {}
    for k in steps:
        known = {tid: combine.masked(kn, drop) for tid, kn in known_at(workload, k, learned).items()}
        if len(known) < 2:
            continue
        by_method: dict[str, Mapping[str, float]] = {}
        if served is not None and k in served:
            by_method["served"] = served[k]
        by_method |= {
            m: v for m, v in heuristic_scores(known).items() if combine.HEURISTICS[m][0] not in drop
        }
        fig = step_report(workload, by_method)
        vs = fig.get("served_vs_best")
        if isinstance(vs, dict):
            fig["in_sample_bound"] = in_sample_bound(workload, known, by_method, vs["best"])
            fig["prompt_bound"] = prompt_bound(workload, known, by_method, vs["best"])
        if any(m in fig for m in METHODS):
            report[f"step{k}"] = fig
    return report


def in_sample_bound(
    workload: Workload, known: Mapping[str, Known], by_method: Mapping[str, Mapping[str, float]], best: str
) -> dict[str, object]:
    """The most the served model's forms reach fitted on the answers (``ranking_bound``), or a heuristic the
    served model has: which, its tau, and its gain over the best free heuristic ``best``, paired by batch."""
    actual = {t.id: float(t.output_tokens) for t in workload.trajectories}
    candidates = {m: v for m, v in by_method.items() if m != "served"} | ranking_bound.in_sample_fits(
        known, actual
    )
    taus = batch_taus(workload, candidates)
    top = max(taus, key=lambda m: (float(np.mean(taus[m])), m in ranking_bound.FORMS))
    return {
        "by": top,
        "tau": round(float(np.mean(taus[top])), 3),
        "vs_best": round(float(np.mean(np.asarray(taus[top]) - np.asarray(taus[best]))), 3),
    }


def prompt_bound(
    workload: Workload, known: Mapping[str, Known], by_method: Mapping[str, Mapping[str, float]], best: str
) -> dict[str, object]:
    """What ranking by the prompt alone reaches: every trajectory scored by the mean log total of its prompt's
    samples, its own among them (an idealisation: no predictor knows them). At admission a prompt's samples
    differ in nothing a predictor can read, so between prompts this is about the most any predictor reaches
    there, and within a prompt it ties. Its tau within batches, over the pairs of different
    prompts, and the latter's gain over the best free heuristic ``best``'s, paired by batch."""
    logs: dict[str, list[float]] = {}
    for t in workload.trajectories:
        logs.setdefault(t.prompt, []).append(float(np.log(max(t.output_tokens, 1))))
    prompt_of = {t.id: t.prompt for t in workload.trajectories}
    scores = {"bound": {i: float(np.mean(logs[prompt_of[i]])) for i in known}, best: by_method[best]}
    out: dict[str, object] = {"tau": round(float(np.mean(batch_taus(workload, scores)["bound"])), 3)}
    apart = batch_taus(workload, scores, between=True)
    if apart["bound"]:  # some batch holds two prompts
        out["between_prompts"] = round(float(np.mean(apart["bound"])), 3)
        out["between_vs_best"] = round(
            float(np.mean(np.asarray(apart["bound"]) - np.asarray(apart[best]))), 3
        )
    return out

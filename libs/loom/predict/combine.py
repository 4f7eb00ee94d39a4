"""What the predictor serves: the text model's estimate combined with everything else known about a
trajectory when it is asked, by weights learned on held-out prompts.

The text model reads one trajectory's context. A rollout system knows more: the prompt's earlier samples (an
earlier epoch of the same prompt), the samples of its own group that finished or are running, how far along
it is. Each alone is a free heuristic (the previous epoch's length, the first sibling to finish, the prompt's
length); the text model alone ranks a batch worse than some of them (Heddle §4.1 claims the opposite, and
Loom's own ``loom bench predictor`` measured it). The combiner takes them all as features:

- always: the prompt's length, the tokens generated so far, the step;
- ``text``: the text model's total;
- ``history``: the prompt's earlier samples: the latest, their mean, shortest and longest (log totals), and
  the mean of those longer than what the trajectory has generated;
- ``finished``: the group's finished samples: the first to finish, their mean, the share of the group done;
- ``pace``: tokens per call so far against the running siblings' (log ratio), once a call is done.

A ridge regression of the log total on them is fitted per *cell*: the pattern of what is available (a trace
of lengths has no text, a first epoch no history, a first call no pace, a group none finished) and a range of
steps. Which serves is chosen per *regime*: what a whole batch has or lacks alike (text, history) and the step
range, since a batch mixes cells (some of its trajectories have a finished sibling, others not) and is ranked
as a whole. A regime's candidates are the combined model (each trajectory by its cell's regression) and each
heuristic available in it (a regression on the heuristic's score alone, which ranks as the heuristic does),
and the blend: one regression on every available heuristic's score together (each floored at what was
generated, as a scheduler would rank by it), fitted on the regime's rows alike, so that one model ranks a whole
batch where the combined cells' regressions each rank part of it. Inner folds (by prompt) of the training data
give every candidate's estimates on prompts it never saw, and Kendall's tau within the training batches, each
ranked whole. The blend is chosen as a heuristic is, by its mean tau: a few weights on scores that each rank a
batch whole, fitted on thousands of rows, its out-of-fold tau is what it serves. The combined model serves a
regime only if it beats the best of the others by a paired sign-flip test over the batches (level
``1 - CONFIDENCE``): where the features add nothing on the inner folds, the regime ranks as its best heuristic
or blend.
A workload with enough prompts gets regimes of its own; the pooled ones, which serve every other workload,
choose their candidate leaving one workload out at a time, for the least it loses to that workload's best
heuristic. (Measured in ``loom bench predictor``'s ``held_out``: from two workloads, that choice still loses to
a third's best heuristic in places.)

The estimate is the log-normal median given that the total exceeds what was generated
(``loom.predict.blend.survived_median``), with the cell's own residual spread.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.predict.blend import survived_median
from loom.predict.evaluate import kendall_tau_b, log_error_sd, log_slope

# Step ranges with a model each: admission, each of the first three calls (the heuristics' order changes call
# by call there: a search group's first sibling finishes at its third to fifth), then wider ranges.
STEP_BUCKETS = (0, 1, 2, 3, 5, 8, 12)
INNER_FOLDS = 4
CONFIDENCE = 0.9
RIDGE = 1.0
BOOTSTRAP = 1000
# Up to this many batches the sign-flip test enumerates every flip.
EXACT_FLIPS = 12
FORMAT = 3
# A workload's own combiner needs this many prompts among its rows; fewer, and the pooled one serves it.
MIN_WORKLOAD_PROMPTS = 24

GROUPS = ("text", "history", "finished", "pace")
# The groups a whole batch has or lacks alike (a job's trace has text or not; its epoch has history or not).
REGIME_GROUPS = ("text", "history")
# Heuristic candidates: name -> (the regime group it needs, or None, and its feature). The first sibling is
# a candidate in every regime: where none has finished it ranks by what was generated (``heuristic``).
HEURISTICS: dict[str, tuple[str | None, str]] = {
    "prompt_length": (None, "log_prompt"),
    "learned": ("text", "log_model"),
    "previous_epoch": ("history", "hist_last"),
    "previous_mean": ("history", "hist_mean"),
    "first_sibling": (None, "fin_first"),
}
BASE = ("log_prompt", "log_generated", "log_step")
FEATURES = {
    "text": ("log_model",),
    "history": ("hist_last", "hist_mean", "hist_min", "hist_max", "hist_surv"),
    "finished": ("fin_first", "fin_mean", "fin_share"),
    "pace": ("pace",),
}


@dataclass(frozen=True)
class Known:
    """What is known of one trajectory when it is asked about, after ``step`` calls."""

    step: int
    generated: float  # tokens it has generated
    prompt_len: float  # tokens of its prompt (its first call's input)
    model_total: float | None = None  # the text model's total; None: no text, or no model
    history: tuple[float, ...] = ()  # totals of the prompt's earlier samples, oldest first
    finished: tuple[float, ...] = ()  # totals of its group's finished samples, in the order they finished
    # (calls, tokens generated) of each of its group's other samples still running
    running: tuple[tuple[int, float], ...] = ()
    workload: str = ""  # the trace set or environment it comes from, where known ("": unknown)

    @property
    def group_size(self) -> int:
        return 1 + len(self.finished) + len(self.running)


def _log(x: float) -> float:
    return math.log(max(float(x), 1.0))


def _logs(xs: Iterable[float]) -> list[float]:
    """``_log`` of each, inline: ``features`` runs on every request the service answers, and a call per
    element was most of its cost (a coding trajectory's history holds 15 samples, the service's up to 64)."""
    return [math.log(x) if x > 1.0 else 0.0 for x in xs]


def features(k: Known) -> dict[str, float]:
    """Every feature available for ``k`` (a group's are present only when the group is)."""
    out = {
        "log_prompt": _log(k.prompt_len),
        "log_generated": math.log1p(max(k.generated, 0.0)),
        "log_step": math.log1p(k.step),
        "log_done": _log(k.generated),
    }
    if k.model_total is not None:
        out["log_model"] = _log(k.model_total)
    if k.history:
        h = _logs(k.history)
        out["hist_last"], out["hist_mean"] = h[-1], sum(h) / len(h)
        out["hist_min"], out["hist_max"] = min(h), max(h)
        # The earlier samples it could still turn out like: those longer than what it has generated.
        done = _log(k.generated)
        above = [x for x in h if x > done]
        out["hist_surv"] = sum(above) / len(above) if above else done
    if k.finished:
        f = _logs(k.finished)
        out["fin_first"], out["fin_mean"], out["fin_share"] = f[0], sum(f) / len(f), len(f) / k.group_size
    paces = _logs([g / c for c, g in k.running if c > 0 and g > 0])
    if k.step > 0 and k.generated > 0 and paces:
        out["pace"] = _log(k.generated / k.step) - sum(paces) / len(paces)
    return out


@dataclass(frozen=True)
class Prepared:
    """What the combiner reads of a trajectory but the text model's total (``prepare``): the service works it
    out while the text model runs on another thread, so that only a sum is left once its answer comes."""

    known: Known
    feats: dict[str, float]


def prepare(k: Known) -> Prepared:
    return Prepared(k, features(dataclasses.replace(k, model_total=None)))


def pattern(feats: dict[str, float]) -> tuple[str, ...]:
    return tuple(g for g in GROUPS if FEATURES[g][0] in feats)


def bucket(step: int) -> int:
    return max(bisect.bisect_right(STEP_BUCKETS, step) - 1, 0)


def cell_columns(cell_pattern: tuple[str, ...]) -> tuple[str, ...]:
    return BASE + tuple(f for g in cell_pattern for f in FEATURES[g])


@dataclass
class Linear:
    """log total = intercept + weights . (x - centre); ``sd`` the residual spread on its training rows."""

    columns: tuple[str, ...]
    weights: list[float]
    intercept: float
    centre: list[float]
    sd: float

    def __post_init__(self) -> None:
        # Summed in Python: numpy's arrays cost more to make than a dozen products (the service calls this on
        # every request).
        self._terms = list(zip(self.columns, self.weights, self.centre, strict=True))

    def centre_of(self, feats: dict[str, float]) -> float:
        return _clip(self.intercept + sum(w * (feats[c] - m) for c, w, m in self._terms))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Log totals of the rows of ``x`` (its columns ``columns``), unclipped: how fits are scored."""
        return self.intercept + (x - np.array(self.centre)) @ np.array(self.weights)

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": list(self.columns),
            "weights": self.weights,
            "intercept": self.intercept,
            "centre": self.centre,
            "sd": self.sd,
        }


# Log totals are clipped to what a trajectory can be (one token to 100M): a regression far outside the
# features it was fitted on extrapolates without bound.
LOG_MAX = math.log(1e8)


# What ``Combiner.total_unread`` puts for a text model's log total that no model it selects reads.
_TEXT_UNREAD = 0.0


def _clip(log_total: float) -> float:
    return min(max(log_total, 0.0), LOG_MAX)


def fit_linear(x: np.ndarray, y: np.ndarray, columns: Sequence[str], alpha: float = RIDGE) -> Linear:
    """Ridge regression on standardised columns, returned in the columns' own units."""
    centre, scale = x.mean(axis=0), x.std(axis=0)
    scale[scale == 0] = 1.0
    z = (x - centre) / scale
    mean = float(y.mean())
    w = np.linalg.solve(z.T @ z + alpha * np.eye(z.shape[1]), z.T @ (y - mean)) / scale
    resid = y - (mean + (x - centre) @ w)
    sd = float(max(np.sqrt(np.mean(resid**2)) if len(y) > 1 else 1.0, 0.05))
    return Linear(tuple(columns), w.tolist(), mean, centre.tolist(), sd)


@dataclass
class Row:
    """One training example: what was known, the true total, and the batch it is ranked within."""

    known: Known
    total: float
    prompt: str  # inner folds are by prompt
    batch: str  # rows ranked together: one workload's batch of prompts at one step
    trajectory: str = ""


@dataclass
class Combiner:
    """A regression per cell, and per regime the choice (``chosen``) of the combined cells or one heuristic's
    regression (``regimes``); and, for each workload it had enough prompts of, a combiner of that workload's
    own (how much history, pace or text tells differs between workloads: one search prompt's trials mostly
    repeat, tool use's vary). A request of another workload, or of none named, is served by the one fitted on
    every workload."""

    cells: dict[str, Linear] = field(default_factory=dict)
    chosen: dict[str, str] = field(default_factory=dict)
    fallback: Linear | None = None
    # The regimes (``regime`` and a step range) a heuristic serves: its regression on the heuristic's score.
    regimes: dict[str, Linear] = field(default_factory=dict)
    workloads: dict[str, Combiner] = field(default_factory=dict)
    # Its error at admission on prompts it never saw (log sd) and how much of its ranking within a workload
    # is real (slope), per workload and for any other ("*"): what placement may trust it to (``admission_fit``).
    admission: dict[str, tuple[float, float]] = field(default_factory=dict)

    def trust(self, workload: str = "") -> tuple[float, float]:
        """(log sd, slope) at admission for a job of ``workload``; for one it was not measured on, the
        pooled error and the least slope of any workload (placement packs only what it can rank)."""
        return self.admission.get(workload) or self.admission.get("*") or (1.0, 1.0)

    def centre(self, k: Known) -> tuple[float, float]:
        return self._centre(k.workload, k.step, features(k))

    def _centre(self, workload: str, step: int, feats: dict[str, float]) -> tuple[float, float]:
        return _centre_by(*self._serving(workload, step, feats), feats)

    def _serving(self, workload: str, step: int, feats: dict[str, float]) -> tuple[Linear, bool]:
        """The regression that serves these features, and whether it reads heuristics' scores (a regime's
        choice) rather than the features themselves (a cell)."""
        own = self.workloads.get(workload)
        if own is not None:
            return own._serving(workload, step, feats)
        b = bucket(step)
        chosen = self.regimes.get(_key(regime(feats), b))
        if chosen is not None:
            return chosen, True
        model = self.cells.get(_key(pattern(feats), b))
        if model is None:  # a cell no training row fell in: the nearest with fewer groups
            model = self._nearest(feats, step)
        return model, False

    def total(self, k: Known) -> float:
        return survived_median(*self.centre(k), k.generated)

    def total_prepared(self, p: Prepared, model_total: float | None) -> float:
        """``total`` of ``p``'s trajectory with the text model's total now known (None: none came)."""
        feats = p.feats if model_total is None else {**p.feats, "log_model": _log(model_total)}
        return survived_median(*self._centre(p.known.workload, p.known.step, feats), p.known.generated)

    def total_unread(self, p: Prepared) -> float | None:
        """``p``'s trajectory's total where it has text but what serves it does not read the text model's
        total (a regime that ranks by another heuristic: search by its previous epoch, say), so that the
        service answers without running the text model; None where it reads it. Any total gives the same
        estimate there: ``_TEXT_UNREAD`` stands in for it only to select the regime with text."""
        feats = {**p.feats, "log_model": _TEXT_UNREAD}
        model, scored = self._serving(p.known.workload, p.known.step, feats)
        if ("h_learned" if scored else "log_model") in model.columns:
            return None
        return survived_median(*_centre_by(model, scored, feats), p.known.generated)

    def _nearest(self, feats: dict[str, float], step: int) -> Linear:
        have = pattern(feats)
        for b in range(bucket(step), -1, -1):
            for size in range(len(have), -1, -1):
                for key, model in self.cells.items():
                    p, kb = _parse(key)
                    if kb == b and len(p) == size and set(p) <= set(have):
                        return model
        if self.fallback is None:
            raise ValueError("the combiner holds no model")
        return self.fallback

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "cells": {k: m.to_json() for k, m in self.cells.items()},
            "chosen": self.chosen,
            "fallback": None if self.fallback is None else self.fallback.to_json(),
            "regimes": {k: m.to_json() for k, m in self.regimes.items()},
            "workloads": {w: c.to_json() for w, c in self.workloads.items()},
            "admission": {w: list(v) for w, v in self.admission.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Combiner:
        if data.get("format") != FORMAT:
            raise ValueError(f"combiner format {data.get('format')!r}, expected {FORMAT}")

        def linear(d: dict[str, Any]) -> Linear:
            return Linear(tuple(d["columns"]), d["weights"], d["intercept"], d["centre"], d["sd"])

        fb = data.get("fallback")
        return cls(
            {k: linear(v) for k, v in data["cells"].items()},
            dict(data["chosen"]),
            None if fb is None else linear(fb),
            {k: linear(v) for k, v in data["regimes"].items()},
            {w: cls.from_json(c) for w, c in data.get("workloads", {}).items()},
            {w: (float(v[0]), float(v[1])) for w, v in data.get("admission", {}).items()},
        )


def _centre_by(model: Linear, scored: bool, feats: dict[str, float]) -> tuple[float, float]:
    """``model``'s log centre and spread for ``feats``: on the heuristics' scores (``scored``, a regime's
    choice) or on the features themselves (a cell)."""
    if scored:
        return model.centre_of({c: heuristic(c.removeprefix("h_"), feats) for c in model.columns}), model.sd
    return model.centre_of(feats), model.sd


def _key(p: tuple[str, ...], b: int) -> str:
    return f"{'+'.join(p) or 'base'}@{b}"


def _parse(key: str) -> tuple[tuple[str, ...], int]:
    p, b = key.split("@")
    return (() if p == "base" else tuple(p.split("+"))), int(b)


def masked(k: Known, drop: Iterable[str]) -> Known:
    """``k`` with some groups of knowledge removed: how a row stands for a first epoch or a trace of lengths."""
    d = set(drop)
    return Known(
        k.step,
        k.generated,
        k.prompt_len,
        None if "text" in d else k.model_total,
        () if "history" in d else k.history,
        () if "finished" in d else k.finished,
        () if "finished" in d else k.running,
        k.workload,
    )


def augmented(rows: Sequence[Row]) -> list[Row]:
    """Every row as it is, without history, without text, and without both: each pattern gets rows."""
    out = []
    for drop in ((), ("history",), ("text",), ("text", "history")):
        out += [
            Row(masked(r.known, drop), r.total, r.prompt, r.batch + "/" + "-".join(drop), r.trajectory)
            for r in rows
        ]
    return out


def fit(rows: Sequence[Row], seed: int = 0) -> Combiner:
    """A combiner fitted on ``rows`` (augmented with every pattern), each cell's model chosen on inner
    folds; and one of its own for each workload with ``MIN_WORKLOAD_PROMPTS`` prompts or more."""
    if not rows:
        raise ValueError("no rows to fit a combiner on")
    # The pooled cells serve workloads nobody trained on: each cell's candidate is chosen on inner folds
    # that are whole workloads, for the least it loses to the best heuristic on any of them.
    workloads = {r.known.workload for r in rows}
    out = _fit_cells(rows, seed, by_workload=len(workloads) > 1)
    by_workload: dict[str, list[Row]] = {}
    for r in rows:
        if r.known.workload:
            by_workload.setdefault(r.known.workload, []).append(r)
    for name, own in sorted(by_workload.items()):
        if len({r.prompt for r in own}) >= MIN_WORKLOAD_PROMPTS:
            out.workloads[name] = _fit_cells(own, seed)
    return out


def regime(feats: dict[str, float]) -> tuple[str, ...]:
    """What a whole batch knows alike: whether there is text (a trace of lengths has none) and history (a
    first epoch has none). Siblings and pace vary within a batch, so a batch mixes cells of one regime."""
    return tuple(g for g in REGIME_GROUPS if FEATURES[g][0] in feats)


def heuristic(name: str, feats: dict[str, float]) -> float:
    """Heuristic ``name``'s log estimate, as a rollout system without a model would rank by it: its feature
    but never below what was generated; what was generated where it has nothing (no sibling finished yet)."""
    col = HEURISTICS[name][1]
    if col == "log_prompt":
        return feats[col]
    done = feats["log_done"]
    return max(feats[col], done) if col in feats else done


def _fit_cells(rows: Sequence[Row], seed: int, by_workload: bool = False) -> Combiner:
    rows = augmented(rows)
    feats = [features(r.known) for r in rows]
    cells: dict[str, list[int]] = {}
    regimes: dict[str, list[int]] = {}
    for i, (r, f) in enumerate(zip(rows, feats, strict=True)):
        b = bucket(r.known.step)
        cells.setdefault(_key(pattern(f), b), []).append(i)
        regimes.setdefault(_key(regime(f), b), []).append(i)
    y = np.array([math.log(max(r.total, 1.0)) for r in rows])
    gen = np.array([r.known.generated for r in rows])
    if by_workload:
        names = sorted({r.known.workload for r in rows})
        folds = np.array([names.index(r.known.workload) for r in rows])
    else:
        folds = np.array([zlib.crc32(f"inner:{seed}:{r.prompt}".encode()) % INNER_FOLDS for r in rows])
    out = Combiner()
    for key, idx in sorted(cells.items()):
        cols = cell_columns(_parse(key)[0])
        out.cells[key] = fit_linear(feature_matrix(feats, idx, cols), y[idx], cols)
    for key, idx in sorted(regimes.items()):
        ix = np.array(idx)
        have = set(_parse(key)[0])
        # Each candidate's heuristic scores (None: the combined cells): one, or the blend's all of them.
        # A heuristic whose score is one value over the regime's rows ranks nothing (the first sibling where
        # none has finished): cross-fitted, its tau within a batch would be the inner fits' intercepts, which
        # differ between a batch's prompts, and one fold chose it over a prompt length that ranked (search,
        # first epoch, at admission).
        heuristics = [n for n in available(have) if np.ptp([heuristic(n, feats[i]) for i in idx]) > 0]
        candidates: dict[str, list[str] | None] = {"combined": None}
        if heuristics:
            candidates |= {"blend": heuristics} | {n: [n] for n in heuristics}
        oof = {n: np.zeros(len(ix)) for n in candidates}
        for inner in range(int(folds.max()) + 1):
            test = folds[ix] == inner
            if not test.any() or test.all():
                continue
            train_ix, test_ix = ix[~test], ix[test]
            for n, scores in candidates.items():
                oof[n][test] = _predict_oof(scores, feats, y, gen, train_ix, test_ix)
        batches = [rows[i].batch for i in idx]
        if by_workload:
            name = _least_regret(oof, y[ix], batches, [rows[i].known.workload for i in idx])
        else:
            name = _choose(oof, y[ix], batches, seed)
        out.chosen[key] = name
        scores = candidates[name]
        if scores is not None:
            h = np.array([[heuristic(n, feats[i]) for n in scores] for i in idx])
            out.regimes[key] = fit_linear(h, y[ix], tuple(f"h_{n}" for n in scores))
    out.fallback = fit_linear(np.array([[f[c] for c in BASE] for f in feats]), y, BASE)
    return out


def available(have: set[str]) -> list[str]:
    """The heuristics a regime with groups ``have`` has (those that need no group, and those it has)."""
    return [n for n, (g, _) in HEURISTICS.items() if g is None or g in have]


def feature_matrix(
    feats: Sequence[dict[str, float]], idx: Iterable[int], columns: Sequence[str]
) -> np.ndarray:
    return np.array([[feats[i][c] for c in columns] for i in idx])


def _predict_oof(
    scores: Sequence[str] | None,
    feats: Sequence[dict[str, float]],
    y: np.ndarray,
    gen: np.ndarray,
    train_ix: np.ndarray,
    test_ix: np.ndarray,
) -> list[float]:
    """Log estimates for ``test_ix`` by a candidate fitted on ``train_ix`` (one regime's rows): the regression
    on heuristic ``scores`` (one heuristic's, or the blend's), or with ``scores`` None the combined model of
    each row's own cell (the regime's base model where the training rows hold none of that cell)."""
    centres, sds = np.zeros(len(test_ix)), np.ones(len(test_ix))
    if scores is not None:
        m = fit_linear(
            np.array([[heuristic(n, feats[i]) for n in scores] for i in train_ix]), y[train_ix], scores
        )
        centres[:] = m.predict(np.array([[heuristic(n, feats[i]) for n in scores] for i in test_ix]))
        sds[:] = m.sd
    else:
        by_cell: dict[tuple[str, ...], list[int]] = {}
        for j, i in enumerate(test_ix):
            by_cell.setdefault(pattern(feats[i]), []).append(j)
        train_cells: dict[tuple[str, ...], list[int]] = {}
        for i in train_ix:
            train_cells.setdefault(pattern(feats[i]), []).append(int(i))
        for p, js in by_cell.items():
            own = train_cells.get(p, [])
            # A cell with too few training rows borrows the regime's, on the columns every row has.
            cols, fit_on = (cell_columns(p), own) if len(own) >= 2 else (BASE, [int(i) for i in train_ix])
            m = fit_linear(feature_matrix(feats, fit_on, cols), y[fit_on], cols)
            centres[js] = m.predict(feature_matrix(feats, [int(test_ix[j]) for j in js], cols))
            sds[js] = m.sd
    return [
        math.log(survived_median(_clip(float(c)), float(s), g))
        for c, s, g in zip(centres, sds, gen[test_ix], strict=True)
    ]


def _batch_taus(oof: dict[str, np.ndarray], y: np.ndarray, batches: Sequence[str]) -> dict[str, np.ndarray]:
    groups: dict[str, list[int]] = {}
    for i, b in enumerate(batches):
        groups.setdefault(b, []).append(i)
    usable = [np.array(g) for g in groups.values() if len(g) >= 2]
    return {n: np.array([kendall_tau_b(p[g], y[g]) for g in usable]) for n, p in oof.items()}


def _least_regret(
    oof: dict[str, np.ndarray], y: np.ndarray, batches: Sequence[str], workloads: Sequence[str]
) -> str:
    """The candidate that loses least to the best heuristic of whichever workload it does worst on (each
    predicted by candidates fitted without that workload); on a tie, a heuristic over the combined model."""
    regret: dict[str, float] = {n: 0.0 for n in oof}
    for w in sorted(set(workloads)):
        mine = np.array([x == w for x in workloads])
        taus = _batch_taus(
            {n: p[mine] for n, p in oof.items()},
            y[mine],
            [b for b, m in zip(batches, mine, strict=True) if m],
        )
        means = {n: float(t.mean()) for n, t in taus.items() if len(t)}
        if not means:
            continue
        # The bar is the workload's best heuristic: not the blend, which is fitted.
        best = max(
            (v for n, v in means.items() if n not in ("combined", "blend")), default=max(means.values())
        )
        for n, v in means.items():
            regret[n] = min(regret[n], v - best)
    return max(regret, key=lambda n: (regret[n], n != "combined", n))


def _choose(oof: dict[str, np.ndarray], y: np.ndarray, batches: Sequence[str], seed: int) -> str:
    """The combined model if it beats the best heuristic by a paired sign-flip test over the batches at level
    ``1 - CONFIDENCE`` (exact over every flip for a few batches, where a bootstrap of four batches would be
    sure of anything); else the best heuristic or the blend by mean tau."""
    taus = _batch_taus(oof, y, batches)
    if not len(taus["combined"]):
        return "combined"
    heuristics = {n: t for n, t in taus.items() if n != "combined"}
    if not heuristics:
        return "combined"
    best = max(heuristics, key=lambda n: (heuristics[n].mean(), n))
    gain = taus["combined"] - heuristics[best]
    return "combined" if gain.mean() > 0 and _sign_flip_p(gain, seed) <= 1 - CONFIDENCE else best


def _sign_flip_p(gain: np.ndarray, seed: int) -> float:
    """One-sided p of a mean gain this large were each batch's gain as likely negative (paired sign flips)."""
    n = len(gain)
    if n <= EXACT_FLIPS:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    else:
        signs = np.random.default_rng(seed).choice((-1, 1), (BOOTSTRAP, n))
    return float(np.mean((signs * gain).mean(axis=1) >= gain.mean() - 1e-12))


def admission_fit(predicted: Sequence[float], rows: Sequence[Row]) -> dict[str, tuple[float, float]]:
    """The error at admission of estimates ``predicted`` for ``rows`` (each a prompt it never saw, at step 0,
    as a first epoch knows it), per workload: the log sd of predicted over actual totals and the slope of
    actual on predicted log totals within it (a job runs one workload: telling a search question from a
    coding task is not ranking); and "*", the pooled log sd with the least slope of any workload."""
    out: dict[str, tuple[float, float]] = {}
    actual = [r.total for r in rows]
    for w in sorted({r.known.workload for r in rows}):
        idx = [i for i, r in enumerate(rows) if r.known.workload == w]
        if len(idx) >= 2:
            p, a = [predicted[i] for i in idx], [actual[i] for i in idx]
            out[w] = (log_error_sd(p, a), log_slope(p, a))
    if len(rows) >= 2:
        out["*"] = (log_error_sd(predicted, actual), min((v[1] for v in out.values()), default=1.0))
    return out


def first_epoch(rows: Sequence[Row]) -> list[Row]:
    """The rows at admission as a first epoch knows them: no earlier samples of the prompt."""
    return [
        Row(masked(r.known, ("history",)), r.total, r.prompt, r.batch, r.trajectory)
        for r in rows
        if r.known.step == 0
    ]

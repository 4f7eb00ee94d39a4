"""How far the served predictor's kind of model could rank one step's batches at all: its candidates fitted on
the very trajectories they rank, their answers known, and the best of them chosen knowing which is best.

The combiner (``loom.predict.combine``) serves a ridge regression on what is known of a trajectory: per
pattern of what is available (``combined``), on every free heuristic's score at once (``blend``), or one
heuristic's score (which ranks as the heuristic does). Fitted on the answers, each is the best of its form in
squared log error, and the best of them in tau is what no predictor of these forms, fitted on other prompts,
reaches in expectation. ``whole`` is one regression over the columns every trajectory has and the heuristics'
scores: the two forms together. It is an idealisation (Kendall's tau is not what a regression minimises, and a
model of another form could rank better): the bar ``loom bench predictor`` holds the served model to is
only worth asking for where this reaches it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from loom.predict import combine
from loom.predict.combine import Known

FORMS = ("combined", "blend", "whole")


def in_sample_fits(known: Mapping[str, Known], actual: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Each form's log estimate of every trajectory in ``known`` (id -> value), fitted on ``actual`` (id ->
    total) of those same trajectories; each at least what the trajectory has generated, as the heuristics'."""
    ids = sorted(known)
    if len(ids) < 2:
        return {}
    feats = [combine.features(known[i]) for i in ids]
    y = np.array([math.log(max(actual[i], 1.0)) for i in ids])
    done = np.array([f["log_done"] for f in feats])
    every = set.intersection(*(set(f) for f in feats))
    scores = [n for n, (g, _) in combine.HEURISTICS.items() if g is None or combine.FEATURES[g][0] in every]
    h = np.array([[combine.heuristic(n, f) for n in scores] for f in feats])
    rows = range(len(ids))
    out = {
        "blend": _fit(h, y),
        "whole": _fit(np.hstack([h, combine.feature_matrix(feats, rows, sorted(every))]), y),
    }
    combined = np.zeros(len(ids))
    cells: dict[tuple[str, ...], list[int]] = {}
    for j, f in enumerate(feats):
        cells.setdefault(combine.pattern(f), []).append(j)
    for p, js in cells.items():
        cols = combine.cell_columns(p)
        combined[js] = _fit(combine.feature_matrix(feats, js, cols), y[js])
    out["combined"] = combined
    return {form: dict(zip(ids, np.maximum(v, done).tolist(), strict=True)) for form, v in out.items()}


def _fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return combine.fit_linear(x, y, [f"x{j}" for j in range(x.shape[1])]).predict(x)

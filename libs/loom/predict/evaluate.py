"""How well a predictor ranks and sizes trajectories: the Heddle paper's two measures (§7.3, Figure 13).

- recall of the long tail: of the trajectories truly in the top ``tail`` fraction by total length, the share
  that the predictor also puts in its top ``tail``;
- Pearson's r between predicted and actual total length;
- Kendall's tau-b, for the order within a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def tail_recall(predicted: Sequence[float], actual: Sequence[float], tail: float = 0.1) -> float:
    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    if len(p) != len(a) or not len(a):
        raise ValueError("predicted and actual must be non-empty and of one length")
    k = max(1, round(len(a) * tail))
    top_a = np.argsort(-a, kind="stable")[:k]
    # Ties in the prediction are broken at random, in expectation: the predictions tied at the cut share
    # its remaining places, so a constant predictor scores at chance rather than by the order of the data.
    cut = np.sort(p)[::-1][k - 1]
    above, at = p > cut, p == cut
    chosen = above.astype(float) + at * (k - above.sum()) / at.sum()
    return float(chosen[top_a].sum() / k)


def pearson(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Pearson's r; 0 when either side has no variance (a constant predictor carries no information)."""
    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    if len(p) != len(a) or len(a) < 2:
        raise ValueError("predicted and actual must be of one length, at least 2")
    if np.ptp(p) == 0 or np.ptp(a) == 0:
        return 0.0
    return float(np.corrcoef(p, a)[0, 1])


def kendall_tau_b(x: Sequence[float], y: Sequence[float], groups: Sequence[str] | None = None) -> float:
    """Kendall's tau-b (ties in either variable corrected for); 0 where either side is constant. With
    ``groups``, over the pairs of different groups alone (a batch's pairs of samples of different prompts)."""
    a, b = np.asarray(x, float), np.asarray(y, float)
    if len(a) != len(b) or (groups is not None and len(groups) != len(a)):
        raise ValueError("x, y and groups must be of one length")
    if len(a) < 2:
        return 0.0
    iu = np.triu_indices(len(a), k=1)
    dx = np.sign(a[:, None] - a[None, :])[iu]
    dy = np.sign(b[:, None] - b[None, :])[iu]
    if groups is not None:
        g = np.unique(np.asarray(groups), return_inverse=True)[1]
        apart = (g[:, None] != g[None, :])[iu]
        dx, dy = dx[apart], dy[apart]
    pairs = len(dx)
    untied_x, untied_y = pairs - np.count_nonzero(dx == 0), pairs - np.count_nonzero(dy == 0)
    if untied_x == 0 or untied_y == 0:
        return 0.0
    return float(np.sum(dx * dy) / np.sqrt(float(untied_x) * float(untied_y)))


def log_error_sd(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """The spread of a predictor's errors in log space: the standard deviation of log((1 + predicted) /
    (1 + actual)). Blending with other evidence weighs the predictor by it."""
    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    if len(p) != len(a) or len(a) < 2:
        raise ValueError("predicted and actual must be of one length, at least 2")
    return float(np.std(np.log1p(p) - np.log1p(a), ddof=1))


def log_slope(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """How much of a difference between two predictions is real: the least-squares slope of log(1 + actual)
    on log(1 + predicted), clipped to [0, 1] (0: the predictions rank nothing; 1: take them at face value)."""
    p, a = np.log1p(np.asarray(predicted, float)), np.log1p(np.asarray(actual, float))
    if len(p) != len(a) or len(a) < 2:
        raise ValueError("predicted and actual must be of one length, at least 2")
    var = float(np.var(p))
    if var == 0:
        return 0.0
    return float(np.clip(np.cov(p, a, bias=True)[0, 1] / var, 0.0, 1.0))


Metric = Callable[[Sequence[float], Sequence[float]], float]


@dataclass(frozen=True)
class Interval:
    """A 95% bootstrap interval of a metric, or of the difference between two predictors' metrics."""

    estimate: float
    low: float
    high: float
    # Share of resamples in which the estimate is above zero (a difference: the first predictor wins).
    above_zero: float


def bootstrap(
    metric: Metric,
    actual: Sequence[float],
    predicted: Sequence[float],
    baseline: Sequence[float] | None = None,
    samples: int = 2000,
    seed: int = 0,
) -> Interval:
    """The metric of ``predicted`` (minus that of ``baseline``, on the same resample: a paired comparison)
    over trajectories drawn with replacement. On a test split of a few dozen trajectories the top 10% is a
    handful, and these intervals say how far apart two recalls must be to mean anything."""
    a, p = np.asarray(actual, float), np.asarray(predicted, float)
    b = None if baseline is None else np.asarray(baseline, float)
    if len(p) != len(a) or (b is not None and len(b) != len(a)) or len(a) < 2:
        raise ValueError("predictions and actual must be of one length, at least 2")

    def value(idx: np.ndarray) -> float:
        v = metric(p[idx], a[idx])
        return v - metric(b[idx], a[idx]) if b is not None else v

    rng = np.random.default_rng(seed)
    draws = np.array([value(rng.integers(0, len(a), len(a))) for _ in range(samples)])
    low, high = np.percentile(draws, [2.5, 97.5])
    return Interval(value(np.arange(len(a))), float(low), float(high), float(np.mean(draws > 0)))

"""How well a predictor ranks and sizes trajectories: the Heddle paper's two measures (§7.3, Figure 13).

- recall of the long tail: of the trajectories truly in the top ``tail`` fraction by total length, the share
  that the predictor also puts in its top ``tail``;
- Pearson's r between predicted and actual total length.
"""

from __future__ import annotations

from collections.abc import Sequence

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

"""``loom bench heddle-suite --against RESULTS``: this run's cells against an earlier run's, cell by cell.

A change to a policy, the predictor or the engine model moves every cell, and a headline (the least ratio,
the learned share) hides which: this compares each cell's throughput with the same cell of an earlier
``results.json`` (the suite writes one to ``--out``), names every cell that lost more than ``TOLERANCE``,
and gives the headlines before and now. Issue 49's bar is that no cell loses more than 1% against the
release.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOLERANCE = 0.01
HEADLINES = ("min_ratio_vs_best", "min_learned_share", "min_ceiling_share")


def load_previous(path: str, gpus: int, ablation_gpus: int) -> dict[str, Any]:
    """An earlier run's results, refused where its cells are not this run's (another cluster size)."""
    try:
        prev: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--against {path}: {e}") from None
    if not isinstance(prev, dict) or prev.get("benchmark") != "heddle-suite" or "overall" not in prev:
        raise ValueError(f"--against {path}: not the results.json of a heddle-suite run")
    if (prev.get("gpus"), prev.get("ablation_gpus")) != (gpus, ablation_gpus):
        raise ValueError(
            f"--against {path}: a run on {prev.get('gpus')} GPUs ({prev.get('ablation_gpus')} for the "
            f"ablations), this one on {gpus} ({ablation_gpus}): its cells are not this run's"
        )
    return prev


def cell_throughputs(results: dict[str, Any], experiments: Sequence[str]) -> dict[str, float]:
    """Every cell's throughput by name: ``overall/<workload>/<model>/<system>``, ``<experiment>/<workload>/<variant>``."""
    out = {
        f"overall/{w}/{m}/{s}": float(r["throughput_tok_s"])
        for w, by_model in results["overall"].items()
        for m, cell in by_model.items()
        for s, r in cell["systems"].items()
    }
    for exp in experiments:
        for w, runs in results.get(exp, {}).items():
            out.update({f"{exp}/{w}/{v}": float(r["throughput_tok_s"]) for v, r in runs.items()})
    return out


def _clairvoyant(cells: dict[str, float]) -> bool:
    return any(c.startswith("prediction/") and c.endswith("/clairvoyant") for c in cells)


def like_for_like(cells: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """An earlier run's cells under the names of ``now``'s. Until the prediction ablation's oracle was split
    in two, it knew each tool latency's draw: that idealisation is the clairvoyant now, and the oracle knows
    each latency at its mean only. A run without clairvoyant cells is one from before, and its oracle is
    compared with the clairvoyant of a run that has one."""
    if _clairvoyant(cells) or not _clairvoyant(now):
        return cells
    return {
        (
            c.removesuffix("/oracle") + "/clairvoyant"
            if c.startswith("prediction/") and c.endswith("/oracle")
            else c
        ): v
        for c, v in cells.items()
    }


def compare(
    prev: dict[str, Any], cur: dict[str, Any], experiments: Sequence[str], tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Each cell both runs hold: now over before. ``losing``: the cells below ``1 - tolerance``, worst
    first; the baselines' cells move only with the engine model, Loom's with everything. ``experiments``: the
    suite's ablations (``heddle_suite.EXPERIMENTS``)."""
    now = cell_throughputs(cur, experiments)
    before = like_for_like(cell_throughputs(prev, experiments), now)
    common = [c for c in now if c in before and before[c] > 0]
    ratios = {c: round(now[c] / before[c], 4) for c in common}
    losing = sorted((c for c in common if ratios[c] < 1 - tolerance), key=lambda c: (ratios[c], c))
    worst = min(common, key=lambda c: (ratios[c], c)) if common else None
    return {
        "cells": ratios,
        "compared": len(common),
        "only_now": sorted(set(now) - set(before)),
        "only_before": sorted(set(before) - set(now)),
        "tolerance": tolerance,
        "losing": [{"cell": c, "ratio": ratios[c]} for c in losing],
        "worst": None if worst is None else {"cell": worst, "ratio": ratios[worst]},
        "headlines": {h: {"before": prev.get(h), "now": cur.get(h)} for h in HEADLINES},
    }

"""``heddle-suite --against``: each cell against the same cell of an earlier run, like for like."""

from __future__ import annotations

from typing import Any

from loom.bench.suite_compare import compare

EXPERIMENTS = ("prediction",)


def _results(prediction: dict[str, float], loom: float = 100.0) -> dict[str, Any]:
    return {
        "overall": {"search": {"qwen3-14b": {"systems": {"heddle": {"throughput_tok_s": loom}}}}},
        "prediction": {"search": {v: {"throughput_tok_s": x} for v, x in prediction.items()}},
    }


def test_a_cell_that_lost_more_than_the_tolerance_is_named() -> None:
    out = compare(_results({"learned": 50.0}), _results({"learned": 49.0}, loom=99.5), EXPERIMENTS)
    assert out["losing"] == [{"cell": "prediction/search/learned", "ratio": 0.98}]
    assert out["cells"]["overall/search/qwen3-14b/heddle"] == 0.995


def test_a_run_from_before_the_clairvoyant_compares_its_oracle_with_the_clairvoyant() -> None:
    # Its oracle knew the latency draws, as the clairvoyant does now; today's oracle (means only) is slower.
    before = _results({"oracle": 80.0, "learned": 50.0})
    now = _results({"oracle": 76.0, "clairvoyant": 80.0, "learned": 50.0})
    out = compare(before, now, EXPERIMENTS)
    assert out["losing"] == []
    assert out["cells"]["prediction/search/clairvoyant"] == 1.0
    assert out["only_now"] == ["prediction/search/oracle"]
    # Two runs from before are compared name for name, and so is a run that has both.
    assert compare(before, before, EXPERIMENTS)["cells"]["prediction/search/oracle"] == 1.0
    out = compare(now, _results({"oracle": 70.0, "clairvoyant": 80.0, "learned": 50.0}), EXPERIMENTS)
    assert [c["cell"] for c in out["losing"]] == ["prediction/search/oracle"]

"""``loom bench engine``: argument parsing, the JSON object on the last line, the acceptance figures."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from loom_cli import bench


def run_bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="loom")
    bench.register(parser.add_subparsers(dest="cmd", required=True))
    assert bench.run(parser.parse_args(["bench", *argv])) == 0
    lines = capsys.readouterr().out.rstrip("\n").split("\n")
    return "\n".join(lines[:-1]), json.loads(lines[-1])


@pytest.mark.parametrize(
    ("model", "published", "tolerance"),
    [("qwen3-8b", 81.7, 0.10), ("qwen3-14b", 47.1, 0.15), ("qwen3-32b", 20.7, 0.15)],
)
def test_h20_batch1_decode_speed_matches_published(
    capsys: pytest.CaptureFixture[str], model: str, published: float, tolerance: float
) -> None:
    tables, r = run_bench(
        capsys, "engine", "--model", model, "--gpu", "h20", "--tp", "1", "--batch", "1", "--json"
    )
    assert r["decode_tok_s"] == pytest.approx(published, rel=tolerance)
    assert r["published_decode_tok_s"] == published
    assert r["ratio"] == pytest.approx(r["decode_tok_s"] / published)
    assert r["per_token_ms"] == pytest.approx(1e3 / r["decode_tok_s"])
    assert r["interference"] == 1.0
    assert "Calibration" in tables


def test_json_schema_and_calibration_section(capsys: pytest.CaptureFixture[str]) -> None:
    _, r = run_bench(capsys, "engine", "--json", "--batch", "32", "--context", "2000")
    assert {"benchmark", "model", "gpu", "tp", "batch", "context", "decode_tok_s", "per_token_ms"} <= set(r)
    assert (r["model"], r["gpu"], r["batch"], r["published_decode_tok_s"], r["ratio"]) == (
        "qwen3-8b",
        "h100",
        32,
        None,
        None,
    )
    assert r["interference"] > 1.0
    assert r["decode_tok_s"] == pytest.approx(32e3 / r["per_token_ms"])
    points = r["calibration"]["points"]
    assert len(points) == 8
    for p in points:
        assert {"gpu", "model", "quantity", "x", "published", "predicted", "rel_error"} <= set(p)
        assert p["rel_error"] == pytest.approx(p["predicted"] / p["published"] - 1)
    assert r["calibration"]["max_abs_rel_error"] < 0.05


def test_sweep_tabulates_per_token_time_and_interference(capsys: pytest.CaptureFixture[str]) -> None:
    tables, r = run_bench(capsys, "engine", "--sweep", "--context", "3000", "--json")
    s = r["sweep"]
    assert s["context_bucket"] == 4096
    assert s["batches"][0] == 1 and s["batches"][-1] == 256
    assert set(s["per_token_ms"]) == set(s["interference"]) == {"1", "2", "4", "8"}
    for tp, factors in s["interference"].items():
        assert factors[0] == 1.0 and factors == sorted(factors)
        assert s["per_token_ms"][tp] == sorted(s["per_token_ms"][tp])
    at_batch1 = [s["per_token_ms"][tp][0] for tp in ("1", "2", "4", "8")]
    assert at_batch1 == sorted(at_batch1, reverse=True)
    assert "Interference F" in tables


def test_quick_throughput_run(capsys: pytest.CaptureFixture[str]) -> None:
    _, r = run_bench(capsys, "engine", "--throughput", "--quick", "--json")
    th = r["throughput"]
    assert th["engines"] == 8 and th["requests"] > th["trajectories"] > 0
    assert th["generated_tokens"] > 1_000_000 and th["prefix_hit_tokens"] > 0
    assert th["ratio"] == pytest.approx(th["sim_tokens_per_wall_s"] / 1e6)
    # The 1M target is the benchmark's to show (about 4-8x on a 2-core machine); under a loaded test run,
    # a lower bound.
    assert th["sim_tokens_per_wall_s"] > 300_000


def test_without_json_prints_tables_only(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="loom")
    bench.register(parser.add_subparsers(dest="cmd", required=True))
    assert bench.run(parser.parse_args(["bench", "engine", "--gpu", "h20"])) == 0
    out = capsys.readouterr().out
    assert "decode tok/s" in out and "{" not in out


def test_unknown_benchmark_and_bad_arguments_are_rejected() -> None:
    parser = argparse.ArgumentParser(prog="loom")
    bench.register(parser.add_subparsers(dest="cmd", required=True))
    for argv in (["bench", "nope"], ["bench", "engine", "--gpu", "b200"], ["bench"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    with pytest.raises(SystemExit):
        bench.run(parser.parse_args(["bench", "engine", "--batch", "0"]))

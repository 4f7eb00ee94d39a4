"""`loom bench` commands run as a user runs them: subprocesses, one JSON object on the last line."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.conftest import need_shared
from tests.e2e.conftest import LOOM


def _bench(*args: str) -> dict[str, Any]:
    r = subprocess.run(
        [LOOM, "bench", *args, "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_bench_engine_reports_calibration_and_throughput() -> None:
    out = _bench("engine", "--model", "qwen3-8b", "--gpu", "h20", "--throughput", "--quick")
    assert 0.9 <= out["decode_tok_s"] / 81.7 <= 1.1
    assert all(abs(p["rel_error"]) < 0.15 for p in out["calibration"]["points"])
    assert out["sim_tokens_per_wall_s"] == out["throughput"]["sim_tokens_per_wall_s"] > 0


def test_bench_placement_matches_the_dp_and_beats_baselines() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("placement", "--quick")
    for row in (out, out["m64"]):
        assert row["same_makespan_as_dp"] is True
        assert row["median_ms"] > 0 and row["makespan_ratio"]["round_robin"] >= 1.0


def test_bench_resources_is_near_exhaustive() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("resources", "--quick")
    assert sum(out["degrees"]) == out["gpus"] == 64
    assert out["gap_to_exhaustive"] <= 0.02
    assert out["speedup_vs_fixed_1"] >= 1.0 and out["speedup_vs_fixed_8"] >= 1.0


def test_bench_rollout_rejects_an_unknown_policy() -> None:
    r = subprocess.run(
        [LOOM, "bench", "rollout", "--quick", "--baselines", "magic"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode != 0 and "bad policy 'magic'" in r.stderr


def test_bench_rollout_compares_the_policy_with_every_baseline() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("rollout", "--quick")
    assert set(out["policies"]) == {"heddle", "verl", "verl_star", "slime"}
    assert set(out["throughput_ratio"]) == {"verl", "verl_star", "slime"}
    for r in out["policies"].values():
        assert r["makespan_over_lb"] >= 1.0 and r["output_tokens"] == out["output_tokens"]
    for key in (
        "throughput_tok_s",
        "makespan_s",
        "lower_bound_s",
        "makespan_over_lb",
        "longest_traj_queueing_s",
        "wall_s",
    ):
        assert key in out

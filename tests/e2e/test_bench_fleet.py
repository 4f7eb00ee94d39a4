"""`loom bench fleet --quick` as a user runs it: the real services over a real nats-server with a fleet of
simulated workers, one JSON object on the last line with every figure the README states."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.conftest import need_shared
from tests.e2e.conftest import LOOM

pytestmark = pytest.mark.timeout(240)

QUICK_WORKERS = 32
SERVICES = ("scheduler", "router", "predictor", "envmgr", "reward")


def test_bench_fleet_quick_reports_the_control_plane() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    r = subprocess.run(
        [LOOM, "bench", "fleet", "--quick", "--repeat", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])

    assert out["benchmark"] == "fleet" and out["nats"] == "single"
    assert out["workers"] >= QUICK_WORKERS
    assert out["trajectories"] >= 1000
    run = out["single"]
    # Every trajectory finished, each with its calls, and the calls flowed.
    assert run["completed"] + run["failed"] == run["trajectories"] and run["failed"] == 0
    assert out["calls"] == run["calls"] >= run["trajectories"]
    assert out["calls_per_s"] > 0 and run["calls_per_s_job"] > 0
    # The router's overhead: a median and a tail from paired probes.
    lat = out["router_overhead_ms"]
    assert run["probe"]["pairs"] >= 10
    assert lat["p50"] <= lat["p99"]
    assert out["intake_traj_per_s"] > 0
    # A CPU figure for every service, the fleet and NATS; the services did some work.
    cpu = out["cpu_s_per_1k_calls"]
    assert set(cpu) == {*SERVICES, "rollout", "nats"}
    assert all(cpu[s] > 0 for s in ("scheduler", "router", "envmgr", "reward", "rollout", "nats"))
    assert out["saturates_first"] in SERVICES
    # The largest fleet one router serves, from each Heddle workload's call rate per GPU.
    assert out["max_gpus_served"] > 0
    assert set(out["call_rates"]) == {"coding", "search", "tool_use"}
    assert all(r["peak_calls_per_gpu_s"] >= r["calls_per_gpu_s"] > 0 for r in out["call_rates"].values())
    assert out["max_gpus_served"] == min(w["at_peak"] for w in run["by_workload"].values())
    assert "max_gpus_derivation" in out
    # Repeated on fresh stacks: the median run reported, each headline figure's runs, median and range.
    assert out["repeat"] == 2 and out["spread"] == run["repeats"]
    calls = out["spread"]["calls_per_s"]
    assert len(calls["runs"]) == 2 and calls["min"] <= run["calls_per_s"] <= calls["max"]
    assert run["calls_per_s"] == pytest.approx(min(calls["runs"]), abs=1e-3)  # the lower middle of two
    assert out["spread"]["max_gpus_served"]["median"] > 0
    # What it ran on, to tell the machine's figure from the code's.
    m = out["machine"]
    assert m["cpus_usable"] >= 1 and m["cpu"] and m["nats_server"].startswith("nats-server")

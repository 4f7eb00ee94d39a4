"""The largest fleet one router serves, from its measured costs (``loom bench fleet``)."""

from __future__ import annotations

from loom.bench.fleet import max_gpus

RATES = {"search": {"peak_calls_per_gpu_s": 55.4, "calls_per_gpu_s": 19.1}}


def test_an_idle_cost_below_the_clocks_tick_sets_no_limit() -> None:
    """A router so cheap idle that a short window measured 0 cores read as "serves no GPUs at all" (the quick
    fleet bench in CI, after the router stopped visiting every worker per event)."""
    run = {"router_idle_sweep": [[8, 0.0], [32, 0.0]], "router_idle_cores": 0.0, "workers": 32}
    out = max_gpus({**run, "router_cpu_ms_per_call": 0.16}, RATES)
    assert out["max_gpus_idle_only"] is None
    assert out["max_gpus_served"] == int(1000 / 0.16 / 55.4) == out["by_workload"]["search"]["at_peak"]


def test_a_measured_idle_cost_bounds_the_fleet() -> None:
    run = {"router_idle_sweep": [[128, 0.5], [256, 1.0]], "router_idle_cores": 1.0, "workers": 256}
    out = max_gpus({**run, "router_cpu_ms_per_call": 0.01}, RATES)
    assert out["max_gpus_idle_only"] == 256 and out["max_gpus_served"] == 256

"""Benchmarks: the virtual-time harness (``loom.bench.harness``), every benchmark's logic and report, and the
modules only benchmarks use (the engine's calibration and iteration profiler, the predictor's ranking and latency,
drafting acceptance on the traces, the RollMux optimum, the training mix). ``loom bench NAME`` (the CLI) parses
the common flags and prints the JSON line; nothing here is imported by a service.
"""

from __future__ import annotations

from loom.bench.registry import Benchmark


def benchmarks() -> tuple[Benchmark, ...]:
    """Every benchmark, in the order ``loom bench`` lists them."""
    from loom.bench import (
        affinity,
        async_train,
        engine,
        envs,
        fleet,
        heddle_suite,
        placement,
        predictor,
        resources,
        reward,
        rollmux,
        rollout,
        sandbox,
        speculative,
        weights,
        weights_colocated,
    )

    return (
        affinity.BENCHMARK,
        async_train.BENCHMARK,
        engine.BENCHMARK,
        envs.BENCHMARK,
        fleet.BENCHMARK,
        heddle_suite.BENCHMARK,
        placement.BENCHMARK,
        predictor.BENCHMARK,
        resources.BENCHMARK,
        rollout.BENCHMARK,
        sandbox.BENCHMARK,
        reward.BENCHMARK,
        rollmux.BENCHMARK,
        speculative.BENCHMARK,
        weights.BENCHMARK,
        weights_colocated.BENCHMARK,
    )

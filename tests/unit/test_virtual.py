"""The virtual-time driver: the same results as a core advanced by hand, multi-turn timing, control calls."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.model.perf import PerfModel
from loom.engine.sim.core import SimCore, build_core
from loom.engine.sim.virtual import VirtualSim

PERF = PerfModel("h100", "qwen3-0.6b")
Log = list[tuple[float, EngineOutput]]


def by_hand(core: SimCore, arrivals: list[tuple[float, EngineRequest]]) -> Log:
    """The reference: advance the core to each of its events, submitting arrivals (all of one instant
    together) whenever they come first."""
    pending = sorted(arrivals, key=lambda a: a[0])
    log: Log = []
    while True:
        t = core.next_event_time()
        if pending and (t is None or pending[0][0] <= t):
            at = pending[0][0]
            while pending and pending[0][0] == at:
                core.submit(pending.pop(0)[1], at)
            continue
        if t is None:
            return log
        log += [(t, out) for out in core.advance(t)]


def virtually(core: SimCore, arrivals: list[tuple[float, EngineRequest]]) -> Log:
    sim = VirtualSim()
    engine = sim.add_engine(core)
    log: Log = []
    for at, req in arrivals:
        sim.call_at(at, lambda req=req: sim.submit(engine, req, lambda out: log.append((sim.now, out))))
    sim.run()
    return log


arrival = st.tuples(
    st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.3]),  # few distinct instants, so that arrivals coincide
    st.integers(1, 2000),
    st.integers(0, 300),
    st.sampled_from([0.0, 1.0]),
    st.one_of(st.none(), st.sampled_from("ab")),
)


@given(arrivals=st.lists(arrival, min_size=1, max_size=30), kv=st.integers(2500, 20_000))
@settings(max_examples=80, deadline=None)
def test_one_engine_matches_a_core_advanced_by_hand(arrivals: list, kv: int) -> None:
    def workload() -> list[tuple[float, EngineRequest]]:
        return [
            (at, EngineRequest(f"r{i}", n_in, n_out, prefix_key=key, priority=prio))
            for i, (at, n_in, n_out, prio, key) in enumerate(arrivals)
        ]

    expected = by_hand(SimCore(PERF, kv, max_running=8, prefill_budget=1024), workload())
    got = virtually(SimCore(PERF, kv, max_running=8, prefill_budget=1024), workload())
    assert got == expected
    assert len(got) == len(arrivals)


TURNS = [(1000, 200, 0.5), (1400, 300, 1.5), (2000, 100, 0.0)]  # input, output, tool call after it


def expected_finishes(perf: PerfModel) -> list[float]:
    finishes, t = [], 0.0
    for n_in, n_out, tool in TURNS:
        # One prefill iteration samples the first token; the rest are decode iterations of one sequence.
        t += perf.iteration_time(n_in, 0, 0) + perf.decode_span(1, n_in + 1, n_out - 1)
        finishes.append(t)
        t += tool
    return finishes


@pytest.mark.parametrize("engines", [1, 3])
def test_trajectories_alternating_with_tool_calls_finish_when_expected(engines: int) -> None:
    perf = PerfModel("h100", "qwen3-8b")
    sim = VirtualSim()
    finishes: dict[int, list[float]] = {}
    for e in range(engines):
        sim.add_engine(SimCore(perf, 100_000))
        finishes[e] = []

    def step(e: int, turn: int) -> None:
        n_in, n_out, tool = TURNS[turn]

        def done(out: EngineOutput) -> None:
            finishes[e].append(sim.now)
            if turn + 1 < len(TURNS):
                sim.call_at(sim.now + tool, lambda: step(e, turn + 1))

        sim.submit(e, EngineRequest(f"t{e}-{turn}", n_in, n_out), done)

    for e in range(engines):
        sim.call_at(0.0, lambda e=e: step(e, 0))
    sim.run()
    # Each engine serves its trajectory alone, so every one finishes as if it were the only one.
    for e in range(engines):
        assert finishes[e] == pytest.approx(expected_finishes(perf), rel=1e-9)
    assert sim.now == pytest.approx(expected_finishes(perf)[-1], rel=1e-9)


def random_cluster(seed: int) -> tuple[list[tuple[float, str, int]], float]:
    rng = random.Random(seed)
    sim = VirtualSim()
    for _ in range(3):
        sim.add_engine(build_core("qwen3-8b", "h100"))
    log: list[tuple[float, str, int]] = []

    def turn(tid: int, left: int, context: int) -> None:
        def done(out: EngineOutput) -> None:
            log.append((sim.now, out.rid, out.cached_tokens))
            if left > 1:
                later = sim.now + rng.expovariate(2.0)
                sim.call_at(later, lambda: turn(tid, left - 1, context + out.output_len + 100))

        req = EngineRequest(f"t{tid}-{left}", context, rng.randint(10, 500), prefix_key=f"t{tid}")
        sim.submit(tid % 3, req, done)

    for tid in range(60):
        sim.call_at(rng.uniform(0, 1), lambda tid=tid: turn(tid, rng.randint(1, 5), rng.randint(100, 3000)))
    sim.run()
    return log, sim.now


def test_runs_are_deterministic() -> None:
    log, end = random_cluster(7)
    assert (log, end) == random_cluster(7)
    assert len({rid for _, rid, _ in log}) == len(log)
    assert [t for t, _, _ in log] == sorted(t for t, _, _ in log)
    assert any(cached for _, _, cached in log)


def test_run_until_stops_the_clock_there_and_resumes_the_same() -> None:
    whole = VirtualSim()
    split = VirtualSim()
    logs: list[Log] = [[], []]
    for sim, log in ((whole, logs[0]), (split, logs[1])):
        e = sim.add_engine(SimCore(PERF, 50_000))
        for i in range(5):
            sim.submit(
                e,
                EngineRequest(f"r{i}", 500 * (i + 1), 1000),
                lambda out, s=sim, lg=log: lg.append((s.now, out)),
            )
    whole.run()
    split.run(until=0.5)
    assert split.now == 0.5 and len(logs[1]) < 5
    split.run()
    assert logs[0] == logs[1]
    assert split.now == whole.now == logs[0][-1][0]


def test_callbacks_of_one_instant_run_in_order_of_scheduling() -> None:
    sim = VirtualSim(start=10.0)
    order: list[str] = []
    sim.call_at(12.0, lambda: order.append("b"))
    sim.call_at(11.0, lambda: order.append("a"))
    sim.call_at(12.0, lambda: order.append("c"))
    sim.call_at(5.0, lambda: order.append(f"late at {sim.now}"))  # in the past: runs now
    sim.run()
    assert order == ["late at 10.0", "a", "b", "c"] and sim.now == 12.0


def test_abort_delivers_an_abort_output() -> None:
    sim = VirtualSim()
    e = sim.add_engine(SimCore(PERF, 50_000))
    outs: list[EngineOutput] = []
    sim.submit(e, EngineRequest("long", 100, 20_000), outs.append)
    sim.call_at(1.0, lambda: sim.abort(e, "long"))
    sim.run()
    assert len(outs) == 1 and outs[0].finish_reason == "abort" and 0 < outs[0].output_len < 20_000
    assert sim.now == 1.0 and not sim.abort(e, "long")


def test_pause_holds_an_engine_and_resume_continues_it() -> None:
    def finish(pause_at: float | None) -> float:
        sim = VirtualSim()
        e = sim.add_engine(SimCore(PERF, 50_000))
        done: list[float] = []
        sim.submit(e, EngineRequest("r", 100, 5000), lambda out: done.append(sim.now))
        if pause_at is not None:
            sim.call_at(pause_at, lambda: sim.pause(e))
            sim.call_at(pause_at + 10.0, lambda: sim.resume(e))
        sim.run()
        return done[0]

    alone = finish(None)
    paused = finish(alone / 2)
    # The iteration under way when it paused is redone.
    assert alone + 10.0 <= paused <= alone + 10.0 + PERF.iteration_time(0, 1, 5100)


def test_update_weights_tags_later_outputs() -> None:
    sim = VirtualSim()
    e = sim.add_engine(SimCore(PERF, 50_000))
    versions: dict[str, str] = {}
    sim.submit(e, EngineRequest("a", 100, 10), lambda out: versions.update(a=out.weight_version))
    sim.call_at(5.0, lambda: sim.update_weights(e, "v2"))
    sim.call_at(
        6.0,
        lambda: sim.submit(e, EngineRequest("b", 100, 10), lambda out: versions.update(b=out.weight_version)),
    )
    sim.run()
    assert versions == {"a": "", "b": "v2"}


@pytest.mark.parametrize("keep_source", [False, True])
def test_migrated_prefix_is_reused_on_the_target(keep_source: bool) -> None:
    perf = PerfModel("h100", "qwen3-8b")
    sim = VirtualSim()
    src, dst = sim.add_engine(SimCore(perf, 100_000)), sim.add_engine(SimCore(perf, 100_000))
    outs: dict[str, EngineOutput] = {}
    lands: list[float] = []

    def migrate(out: EngineOutput) -> None:
        outs[out.rid] = out
        t = sim.migrate_prefix(src, dst, "traj", keep_source=keep_source, bandwidth_gbps=50)
        lands.append(t)
        assert t == pytest.approx(sim.now + 4100 * perf.model.kv_bytes_per_token / 50e9)
        sim.call_at(t, lambda: sim.submit(dst, EngineRequest("t1", 4500, 10, prefix_key="traj"), record))

    def record(out: EngineOutput) -> None:
        outs[out.rid] = out

    sim.submit(src, EngineRequest("t0", 4000, 100, prefix_key="traj"), migrate)
    sim.run()
    assert outs["t1"].cached_tokens == 4100
    assert sim.engines[src].cache.length("traj") == (4100 if keep_source else 0)

"""RollMux co-scheduling policies: Theorem 1 on the executed round robin, saturated groups refused, every
admission within every member's SLO and memory, the offline optimum as a bound, long-tail migration."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from loom.bench.harness.cosched import Arrival, execute_group, simulate
from loom.bench.rollmux_optimum import optimal_cost
from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.group import Group
from loom.policies.rollmux.intergroup import (
    ISOLATED,
    MAX_DIRECT,
    CoScheduler,
    RollMux,
    SoloDisaggregation,
    placements,
)
from loom.policies.rollmux.job import RLJob, sample_job
from loom.policies.rollmux.roundrobin import (
    ROLLOUT,
    TRAIN,
    TRAIN_POOL,
    Phase,
    RoundRobinExecutor,
    meta_period,
    round_robin_ends,
    tail_gpus,
)

IDEAL = ClusterSpec(warm_start=False)  # the paper's model for Theorem 1: switches are free

times = st.floats(1.0, 600.0, allow_nan=False)


def _cycle_and_load(phases: list[Phase]) -> tuple[float, float]:
    per_node: dict[int, float] = {}
    for p in phases:
        for n in p.nodes:
            per_node[n] = per_node.get(n, 0.0) + p.roll
    return max(p.roll + p.train for p in phases), max(sum(p.train for p in phases), max(per_node.values()))


def _meta_iteration(
    ran: list[tuple[int, str, tuple[int, ...], float, float]], jobs: int, iters: int
) -> float:
    """Steady-state meta-iteration of an executed schedule: the last training's end, per iteration."""
    ends = [end for _, phase, _, _, end in ran if phase == TRAIN]
    ends.sort()
    first_half, last = ends[jobs * (iters // 2) - 1], ends[-1]
    return (last - first_half) / (iters - iters // 2)


def _no_overlap(ran: list[tuple[int, str, tuple[int, ...], float, float]]) -> None:
    by_resource: dict[int, list[tuple[float, float]]] = {}
    for _, _, resources, start, end in ran:
        for r in resources:
            by_resource.setdefault(r, []).append((start, end))
    for spans in by_resource.values():
        spans.sort()
        for (_, e0), (s1, _) in itertools.pairwise(spans):
            assert s1 >= e0 - 1e-9


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(times, times, st.sampled_from([(0,), (1,), (2, 3)])), min_size=1, max_size=5),
)
def test_theorem_1_unsaturated_round_robin_runs_in_the_longest_solo_cycle(jobs: list) -> None:
    """Pools partitioned into node sets (the paper's one-node proof, generalised): in any unsaturated group
    the live executor completes a meta-iteration in the longest member's solo cycle."""
    phases = [Phase(nodes, r, t) for r, t, nodes in jobs]
    cycle, load = _cycle_and_load(phases)
    if load > cycle:
        return
    assert meta_period(phases) == pytest.approx(cycle, rel=1e-9)
    ran = execute_group(phases, 6)
    _no_overlap(ran)
    assert _meta_iteration(ran, len(phases), 6) == pytest.approx(cycle, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(times, times, st.sets(st.integers(0, 3), min_size=1, max_size=2)), min_size=1, max_size=5
    )
)
@example([(258.0, 1.0, {1}), (1.0, 95.0, {0}), (262.0, 3.0, {0}), (1.0, 25.0, {1}), (113.0, 251.0, {0})])
def test_the_executor_runs_the_schedule_the_scheduler_simulates(jobs: list) -> None:
    """Overlapping node sets too: the SLO check's recurrence is what the live executor does."""
    phases = [Phase(tuple(sorted(nodes)), r, t) for r, t, nodes in jobs]
    ran = execute_group(phases, 12)
    _no_overlap(ran)
    executed = sorted(end for _, phase, _, _, end in ran if phase == TRAIN)[len(phases) - 1 :: len(phases)]
    assert executed == pytest.approx(round_robin_ends(phases, 12), rel=1e-12)
    cycle, load = _cycle_and_load(phases)
    assert meta_period(phases) >= max(cycle, load) - 1e-6


def _job(jid: str, roll: float, train: float, slo: float = 2.0, model: str = "7b", nodes: int = 1) -> RLJob:
    return RLJob(jid, model, roll, train, slo, nodes, nodes)


def test_a_saturated_group_is_refused_even_for_a_job_that_would_fit_its_slo() -> None:
    state = CoScheduler(IDEAL, RollMux())
    state.submit(_job("a", 300, 100))
    d = state.submit(_job("b", 100, 300))  # complementary: bubbles exactly filled
    assert d.group == 0 and d.period == pytest.approx(400)
    g = state.groups[0]
    assert g.saturated()
    d = state.submit(_job("c", 10, 10, slo=2.0))
    assert d.group != 0 and d.strategy == ISOLATED


def test_direct_packing_fills_a_bubble_and_rollout_scaling_adds_only_rollout_nodes() -> None:
    state = CoScheduler(IDEAL, RollMux())
    state.submit(_job("big", 300, 100, slo=1.0))
    d = state.submit(_job("small", 80, 60, slo=3.0))
    assert (d.group, d.delta, d.period) == (0, 0.0, pytest.approx(400))  # big's solo cycle, no slowdown
    heavy = CoScheduler(IDEAL, RollMux())
    heavy.submit(_job("r1", 400, 100, slo=1.0))
    d = heavy.submit(_job("r2", 380, 100, slo=1.05))  # two rollout-heavy jobs contend for one rollout node
    assert d.strategy == "scaling" and d.delta == pytest.approx(IDEAL.roll_node_cost())
    assert heavy.groups[0].train_nodes == 1 and len(heavy.groups[0].nodes) == 2


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from(["mixed", "rollout_heavy", "balanced"]))
def test_every_admission_keeps_every_member_within_slo_and_memory(seed: int, workload: str) -> None:
    rng = random.Random(seed)
    cluster = ClusterSpec(max_group_size=rng.randint(2, 5))
    state = CoScheduler(cluster, RollMux())
    for i in range(40):
        if state.where and rng.random() < 0.2:
            state.depart(rng.choice(sorted(state.where)))
        job = sample_job(f"j{i}", workload, rng)
        saturated = {g.id for g in state.groups.values() if g.saturated()}
        d = state.submit(job)
        assert d.group not in saturated
        for g in state.groups.values():
            period = g.period()
            assert all(period <= m.job.budget + 1e-6 for m in g.members.values())
            assert g.train_mem_free() >= -1e-6 and all(g.roll_mem_free(n) >= -1e-6 for n in g.nodes)
            assert len(g.members) <= cluster.max_group_size


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6))
def test_the_offline_optimum_bounds_online_and_solo(seed: int, n: int) -> None:
    rng = random.Random(seed)
    jobs = [sample_job(f"j{i}", "mixed", rng) for i in range(n)]
    state = CoScheduler(IDEAL, RollMux())
    for j in jobs:
        state.submit(j)
    best = optimal_cost(jobs, IDEAL)
    solo = sum(IDEAL.cost(j.roll_nodes, j.train_nodes) for j in jobs)
    assert best <= state.cost() + 1e-6 <= solo + 1e-6


def test_the_optimum_finds_the_complementary_pairs() -> None:
    jobs = [
        _job("a", 300, 100, 1.0),
        _job("b", 100, 300, 1.0),
        _job("c", 300, 100, 1.0),
        _job("d", 100, 300, 1.0),
    ]
    assert optimal_cost(jobs, IDEAL) == pytest.approx(2 * IDEAL.cost(1, 1))


def test_long_tail_migration_starts_the_next_rollout_on_the_freed_gpus() -> None:
    assert tail_gpus(0.5, 8) is None and tail_gpus(1.0, 8) is None
    assert tail_gpus(0.8, 8) == 2 and tail_gpus(0.95, 16) == 1
    ex = RoundRobinExecutor(gpus_per_node=8)
    ex.add("a", (0,))
    ex.add("b", (0,))
    [p] = ex.request("a", ROLLOUT)
    assert p.gpus == {0: 8}
    assert ex.request("b", ROLLOUT) == []  # b waits for its turn on node 0
    migration, granted = ex.progress("a", 0.85)
    assert migration is not None and (migration.node, migration.gpus) == (0, 2)
    assert [(g.job, g.gpus) for g in granted] == [("b", {0: 6})]
    assert ex.done("a", ROLLOUT) == []  # the tail ends; b keeps its turn
    assert [g.job for g in ex.request("a", TRAIN)] == ["a"]


def test_executor_passes_turns_when_a_job_leaves_and_refuses_bad_calls() -> None:
    ex = RoundRobinExecutor()
    for j in "abc":
        ex.add(j, (0,))
    ex.request("a", ROLLOUT)
    ex.request("c", ROLLOUT)
    assert [p.job for p in ex.remove("a")] == []  # b's turn now, but b has not asked
    assert [p.job for p in ex.remove("b")] == ["c"]
    with pytest.raises(ValueError):
        ex.done("c", TRAIN)
    with pytest.raises(ValueError):
        ex.request("c", ROLLOUT)
    with pytest.raises(KeyError):
        ex.request("zz", ROLLOUT)
    with pytest.raises(ValueError):
        ex.add("c", (1,))
    assert ex.resources[TRAIN_POOL].order == ["c"]


def test_job_and_cluster_validation() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        RLJob("x", "70b", 1, 1)
    with pytest.raises(ValueError, match="SLO"):
        RLJob("x", "7b", 1, 1, slo=0.5)
    with pytest.raises(ValueError, match="unknown workload"):
        sample_job("x", "nope", random.Random(0))
    with pytest.raises(ValueError):
        ClusterSpec(max_group_size=0)


def test_trace_replay_solo_cost_and_loom_slo() -> None:
    rng = random.Random(3)
    arrivals = [Arrival(i * 600.0, sample_job(f"j{i}", "mixed", rng), 7200.0) for i in range(30)]
    solo = simulate(arrivals, ClusterSpec(), SoloDisaggregation())
    expected = sum(ClusterSpec().cost(a.job.roll_nodes, a.job.train_nodes) * 2 for a in arrivals)
    assert solo.dollars == pytest.approx(expected) and solo.slo_attainment == 1.0
    for model in ("duration", "iterations"):
        loom = simulate(arrivals, ClusterSpec(), RollMux(), model)
        assert loom.slo_attainment == 1.0 and loom.dollars < solo.dollars
        assert loom.timeline[-1][1:] == (0.0, 0, 0)  # every group gone at the end
    g = Group(0, 1, IDEAL)
    assert g.period() == 0.0 and not g.saturated()


def test_placement_candidates_stay_few_for_large_jobs() -> None:
    """GENERATEPLACEMENTS enumerates every direct packing only while they are few: a 100-node job in a group of
    256 nodes (C(104, 4), some 4.6 million packings among the 104 least loaded) is placed at once."""
    cluster = ClusterSpec(roll_node_mem_gb=2048.0, train_node_mem_gb=2048.0)
    state = CoScheduler(cluster, RollMux())
    state.submit(RLJob("big", "3b", 1000.0, 900.0, 10.0, 256, 2))
    state.submit(RLJob("wide", "3b", 1000.0, 900.0, 10.0, 44, 2))
    group = next(iter(state.groups.values()))
    assert len(group.nodes) == 256
    job = RLJob("next", "3b", 1000.0, 900.0, 10.0, 100, 2)
    options = list(placements(group, job))
    assert len(options) <= MAX_DIRECT + job.roll_nodes + 1
    assert all(len(nodes) == job.roll_nodes for nodes, _ in options)
    small = list(placements(group, RLJob("small", "3b", 10.0, 9.0, 10.0, 2, 1)))
    assert len([o for o in small if o[1] == 0]) == 15  # every packing of 2 among the 6 least loaded

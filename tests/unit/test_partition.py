"""Presorted DP placement against brute force over every assignment (Heddle Lemma 5.1, Formula 3)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.policies.partition import WorkerProfile, coarsen, presorted_dp


def _profile(per_token_s: float, increments: list[float], saturation: float = float("inf")) -> WorkerProfile:
    # F[0] unused, F[1] = 1, then nondecreasing: a monotone interference factor.
    f = np.concatenate([[0.0, 1.0], 1.0 + np.cumsum(increments)])
    return WorkerProfile(per_token_s, f, saturation)


def _brute_force(
    lengths: list[float],
    workers: list[WorkerProfile],
    weights: list[float] | None = None,
    tool: list[float] | None = None,
) -> float:
    """Min over all m^n assignments of trajectories to workers, vectorised; a group pays its members'
    longest tool time on top of its generation."""
    n, m = len(lengths), len(workers)
    L = np.asarray(lengths)
    W = np.ones(n) if weights is None else np.asarray(weights)
    T = np.zeros(n) if tool is None else np.asarray(tool)
    assign = np.array(list(itertools.product(range(m), repeat=n)))  # (m^n, n)
    worst = np.zeros(len(assign))
    for w, prof in enumerate(workers):
        mine = assign == w
        size = np.where(mine, W[None, :], 0.0).sum(axis=1)
        work = np.where(mine, (L * W)[None, :], 0.0).sum(axis=1)
        head = np.where(mine, L[None, :], 0.0).max(axis=1)
        tools = np.where(mine, T[None, :], 0.0).max(axis=1)
        worst = np.maximum(worst, np.where(size > 0, prof.group_time(head, size, work) + tools, 0.0))
    return float(worst.min())


lengths_st = st.lists(st.floats(1, 50_000, allow_nan=False), min_size=1, max_size=9)
increments_st = st.lists(st.floats(0, 2, allow_nan=False), min_size=9, max_size=9)


saturation_st = st.one_of(st.just(float("inf")), st.floats(1, 8))


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, m=st.integers(1, 4), t=st.floats(1e-3, 0.1), inc=increments_st, sat=saturation_st)
def test_homogeneous_optimum_equals_brute_force(
    lengths: list[float], m: int, t: float, inc: list[float], sat: float
) -> None:
    # Without saturation Lemma 5.1 holds: the contiguous optimum is the optimum. With it, a group's time
    # also has a work term (sum of lengths at the saturated rate), which makes the problem a packing one:
    # the solvers are then exact over contiguous partitions, and never beat the brute force.
    workers = [_profile(t, inc, sat)] * m
    best = _brute_force(lengths, workers)
    want = best if sat == float("inf") else _best_contiguous(lengths, [1.0] * len(lengths), workers)
    assert want >= best * (1 - 1e-9)
    for method in ("parametric", "dp"):
        got = presorted_dp(lengths, workers, method=method)
        assert got.makespan == pytest.approx(want, rel=1e-9)
        # The partition achieves the makespan it reports, and places every trajectory once.
        assert sorted(np.concatenate([got.order[a:b] for a, b in got.bounds])) == list(range(len(lengths)))
        assert max(got.group_times) == pytest.approx(got.makespan, rel=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    lengths=lengths_st,
    ts=st.lists(st.sampled_from([0.004, 0.006, 0.01, 0.02]), min_size=1, max_size=4),
    incs=st.lists(increments_st, min_size=4, max_size=4),
)
def test_heterogeneous_solvers_agree_and_bound_the_brute_force(
    lengths: list[float], ts: list[float], incs: list[list[float]]
) -> None:
    workers = [_profile(t, incs[i]) for i, t in enumerate(ts)]
    fast = presorted_dp(lengths, workers, method="parametric")
    slow = presorted_dp(lengths, workers, method="dp")
    assert fast.makespan == pytest.approx(slow.makespan, rel=1e-9)
    # The sorted mapping is Heddle's heuristic for heterogeneous workers: never better than optimal.
    assert fast.makespan >= _brute_force(lengths, workers) * (1 - 1e-9)
    # Longest trajectories sit on the fastest workers.
    speed_of = {i: workers[w].per_token_s for i, w in enumerate(fast.assignment())}
    longest = int(np.argmax(lengths))
    assert speed_of[longest] == min(speed_of.values())


def _best_contiguous(
    lengths: list[float],
    weights: list[float],
    workers: list[WorkerProfile],
    prefill: list[float] | None = None,
    tool: list[float] | None = None,
) -> float:
    """Min over every way to cut the length-sorted trajectories into len(workers) runs (empty allowed); a
    run pays the longest tool time from its first trajectory to the end of the order."""
    n = len(lengths)
    pre = prefill or [0.0] * n
    tl = tool or [0.0] * n
    order = sorted(range(n), key=lambda i: -lengths[i])
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), len(workers) - 1):
        edges = [0, *cuts, n]
        worst = 0.0
        for prof, a, b in zip(workers, edges, edges[1:], strict=False):
            if b > a:
                share = [max(weights[i] * prof.weight_scale, prof.min_weight) for i in order[a:b]]
                size = np.array([sum(share)])
                # Prefill tokens in the worker's weight-tokens: its prefill time over its work rate.
                per = prof.prefill_s / (prof.per_token_s * prof.work_rate) if prof.work_rate else 0.0
                decode = sum(w * lengths[i] for w, i in zip(share, order[a:b], strict=True))
                work = np.array([decode + per * sum(pre[i] for i in order[a:b])])
                gen = float(prof.group_time(np.array([lengths[order[a]]]), size, work)[0])
                worst = max(worst, gen + max(tl[i] for i in order[a:]))
        best = min(best, worst)
    return best


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.floats(1, 50_000), st.floats(0.05, 6)), min_size=1, max_size=8),
    m=st.integers(1, 3),
    inc=increments_st,
    sat=saturation_st,
)
def test_weighted_optimum_equals_the_best_contiguous_partition(
    data: list[tuple[float, float]], m: int, inc: list[float], sat: float
) -> None:
    # With weights, packing is a bin-packing problem; Formula 3 is exact over contiguous partitions of the
    # length order (Heddle's restriction), which is what both solvers must match.
    lengths = [a for a, _ in data]
    weights = [b for _, b in data]
    workers = [_profile(0.01, inc, sat)] * m
    want = _best_contiguous(lengths, weights, workers)
    for method in ("parametric", "dp"):
        got = presorted_dp(lengths, workers, method=method, weights=weights)
        assert got.makespan == pytest.approx(want, rel=1e-9)
        assert max(got.group_times) == pytest.approx(got.makespan, rel=1e-12)
    # Unit weights change nothing.
    assert presorted_dp(lengths, workers, weights=[1.0] * len(lengths)).makespan == pytest.approx(
        presorted_dp(lengths, workers).makespan, rel=1e-12
    )


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.floats(1, 50_000), st.floats(0.05, 6), st.floats(0, 100_000)), min_size=1, max_size=7
    ),
    kinds=st.lists(
        st.tuples(
            st.sampled_from([0.004, 0.01]),
            st.sampled_from([0.0, 0.5, 2.0]),
            st.floats(0.05, 2),
            st.sampled_from([0.0, 1e-5, 1e-3]),
            st.sampled_from([1.0, 0.3]),
        ),
        min_size=1,
        max_size=3,
    ),
    inc=increments_st,
    sat=st.floats(1, 8),
)
def test_per_worker_floors_work_and_prefill_rates_match_the_best_contiguous_partition(
    data: list[tuple[float, float, float]],
    kinds: list[tuple[float, float, float, float, float]],
    inc: list[float],
    sat: float,
) -> None:
    # Each worker weighs a trajectory in its own units (weight_scale), at least its own batch slot
    # (min_weight), drains work at its own rate (work_s) and charges prefill at its own (prefill_s): the
    # solvers still find the best contiguous partition over the sorted workers.
    lengths = [a for a, _, _ in data]
    weights = [b for _, b, _ in data]
    prefill = [c for _, _, c in data]
    base = _profile(0.01, inc, sat)
    workers = [
        WorkerProfile(
            t, base.interference, sat, work_s=t * rate, min_weight=floor, prefill_s=pre, weight_scale=scale
        )
        for t, floor, rate, pre, scale in kinds
    ]
    ordered = sorted(workers, key=lambda w: w.per_token_s)
    want = _best_contiguous(lengths, weights, ordered, prefill)
    for method in ("parametric", "dp"):
        got = presorted_dp(lengths, workers, method=method, weights=weights, prefill=prefill)
        assert got.makespan == pytest.approx(want, rel=1e-9)
        assert max(got.group_times) == pytest.approx(got.makespan, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    data=st.lists(st.tuples(st.floats(1, 50_000), st.floats(0.05, 6)), min_size=1, max_size=40),
    m=st.integers(1, 6),
    inc=increments_st,
    sat=saturation_st,
)
def test_weighted_solvers_agree(
    data: list[tuple[float, float]], m: int, inc: list[float], sat: float
) -> None:
    lengths = [a for a, _ in data]
    weights = [b for _, b in data]
    workers = [_profile(0.01 * (1 + i % 2), inc, sat) for i in range(m)]
    fast = presorted_dp(lengths, workers, weights=weights)
    slow = presorted_dp(lengths, workers, method="dp", weights=weights)
    assert fast.makespan == pytest.approx(slow.makespan, rel=1e-9)


def test_fractional_sizes_interpolate_and_floor_at_one_trajectory() -> None:
    prof = WorkerProfile(0.01, np.array([0.0, 1.0, 3.0, 4.0]))
    got = prof.factor(np.array([0.0, 0.3, 1.0, 1.5, 3.0, 5.0]))
    assert got.tolist() == pytest.approx([0.0, 1.0, 1.0, 2.0, 4.0, 6.0])


def test_aggregation_keeps_the_head_exact_and_costs_little() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.lognormal(9, 1, 4000)
    f = np.concatenate([[0.0], 1.0 + 0.01 * np.arange(5000)])
    workers = [WorkerProfile(0.01, f)] * 16
    exact = presorted_dp(lengths, workers)
    coarse = presorted_dp(lengths, workers, max_items=512)
    assert coarse.makespan >= exact.makespan * (1 - 1e-12)
    assert coarse.makespan <= exact.makespan * 1.01
    # Every trajectory is placed exactly once, and the longest ones stay where the exact solver put them.
    assert sum(b - a for a, b in coarse.bounds) == len(lengths)
    assert np.bincount(coarse.assignment(), minlength=16).sum() == len(lengths)
    head = exact.order[:64]
    assert (coarse.assignment()[head] == exact.assignment()[head]).mean() > 0.9


def test_bad_input_is_rejected() -> None:
    w = [WorkerProfile(0.01, np.array([0.0, 1.0, 2.0]))]
    with pytest.raises(ValueError, match="no workers"):
        presorted_dp([1.0], [])
    with pytest.raises(ValueError, match="finite"):
        presorted_dp([float("nan")], w)
    with pytest.raises(ValueError, match="nondecreasing"):
        presorted_dp([1.0, 2.0, 3.0], [WorkerProfile(0.01, np.array([0.0, 1.0, 0.5, 0.7]))])
    with pytest.raises(ValueError, match="positive"):
        presorted_dp([1.0, 2.0], w, weights=[1.0, 0.0])
    with pytest.raises(ValueError, match="weights for"):
        presorted_dp([1.0, 2.0], w, weights=[1.0])
    with pytest.raises(ValueError, match="method"):
        presorted_dp([1.0], w, method="magic")
    empty = presorted_dp([], w)
    assert empty.makespan == 0.0 and empty.bounds == [(0, 0)]


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.floats(1, 50_000), st.floats(0, 300)), min_size=1, max_size=8),
    ts=st.lists(st.sampled_from([0.004, 0.01, 0.02]), min_size=1, max_size=3),
    inc=increments_st,
    sat=saturation_st,
)
def test_tool_time_is_paid_by_each_group_and_both_solvers_stay_exact(
    data: list[tuple[float, float]], ts: list[float], inc: list[float], sat: float
) -> None:
    lengths = [a for a, _ in data]
    tool = [b for _, b in data]
    workers = [_profile(t, inc, sat) for t in ts]
    want = _best_contiguous(
        lengths, [1.0] * len(lengths), sorted(workers, key=lambda w: w.per_token_s), tool=tool
    )
    for method in ("parametric", "dp"):
        got = presorted_dp(lengths, workers, method=method, tool=tool)
        assert got.makespan == pytest.approx(want, rel=1e-9)
        assert max(got.group_times) == pytest.approx(got.makespan, rel=1e-12)
    # A group pays at least its members' longest tool time: never better than every assignment can do.
    assert got.makespan >= _brute_force(lengths, workers, tool=tool) * (1 - 1e-9)
    # Tool time that grows with length (more calls) is each group's own longest: there the best contiguous
    # partition with exact per-group tool times is what the solvers find.
    scaled = [x / 100.0 for x in lengths]
    exact = presorted_dp(lengths, workers, tool=scaled).makespan
    assert exact == pytest.approx(presorted_dp(lengths, workers, method="dp", tool=scaled).makespan, rel=1e-9)
    assert presorted_dp(lengths, workers, tool=[0.0] * len(lengths)).makespan == pytest.approx(
        presorted_dp(lengths, workers).makespan, rel=1e-12
    )


@given(st.lists(st.floats(1.0, 1e6), min_size=1, max_size=40), st.floats(0.01, 2.0))
def test_coarsening_keeps_the_order_and_moves_no_estimate_past_half_the_error(
    lengths: list[float], log_sd: float
) -> None:
    out = coarsen(lengths, log_sd)
    for (a, ca), (b, cb) in itertools.product(zip(lengths, out, strict=True), repeat=2):
        assert a > b or ca <= cb  # monotone: a tie at most, never a swap
    assert all(abs(math.log(c) - math.log(x)) <= log_sd / 2 + 1e-9 for x, c in zip(lengths, out, strict=True))
    assert coarsen(lengths, 0.0) == lengths


def _contiguous_cuts(n: int, m: int) -> list[list[int]]:
    return [[0, *c, n] for c in itertools.combinations_with_replacement(range(n + 1), m - 1)]


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.floats(1, 50_000), st.floats(0.05, 3), st.floats(0, 200)), min_size=1, max_size=8
    ),
    m=st.integers(1, 4),
    inc=increments_st,
    sat=st.floats(1, 6),
    slack=st.sampled_from([1.0, 1.0, 1.05, 1.3, 2.0]),
)
def test_a_spread_partition_meets_the_optimum_within_its_slack_and_loads_no_worker_further_past_saturation_than_it_must(
    data: list[tuple[float, float, float]], m: int, inc: list[float], sat: float, slack: float
) -> None:
    """Against brute force over every contiguous partition: the makespan is within ``slack`` of the
    optimum, and of the partitions that are, none loads its most loaded worker less, in multiples of
    saturation."""
    lengths = [a for a, _, _ in data]
    weights = [b for _, b, _ in data]
    tool = [c for _, _, c in data]
    prof = _profile(0.01, inc, sat)
    workers = [prof] * m
    got = presorted_dp(lengths, workers, weights=weights, tool=tool, spread=True, slack=slack)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])

    def cost(edges: list[int]) -> tuple[float, float]:
        worst, load = 0.0, 0.0
        for a, b in itertools.pairwise(edges):
            if b > a:
                idx = order[a:b]
                size = sum(weights[i] for i in idx)
                work = sum(weights[i] * lengths[i] for i in idx)
                gen = float(
                    prof.group_time(np.array([lengths[idx[0]]]), np.array([size]), np.array([work]))[0]
                )
                worst = max(worst, gen + max(tool[i] for i in order[a:]))
                load = max(load, size / sat)
        return worst, load

    costs = [cost(e) for e in _contiguous_cuts(len(lengths), m)]
    optimum = min(c for c, _ in costs)
    assert got.makespan <= optimum * slack * (1 + 1e-7)
    if slack == 1.0:
        assert got.makespan == pytest.approx(optimum, rel=1e-7)
    least = min(load for c, load in costs if c <= optimum * slack * (1 + 1e-7))
    mine = max(sum(weights[i] for i in got.order[a:b]) / sat for a, b in got.bounds if b > a)
    assert mine <= least * (1 + 1e-6) + 1e-6, (data, m, inc, sat, got.bounds, optimum, got.makespan)

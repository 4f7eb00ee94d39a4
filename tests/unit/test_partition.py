"""Presorted DP placement against brute force over every assignment (Heddle Lemma 5.1, Formula 3)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.policies.partition import WorkerProfile, presorted_dp


def _profile(per_token_s: float, increments: list[float]) -> WorkerProfile:
    # F[0] unused, F[1] = 1, then nondecreasing: a monotone interference factor.
    f = np.concatenate([[0.0, 1.0], 1.0 + np.cumsum(increments)])
    return WorkerProfile(per_token_s, f)


def _brute_force(lengths: list[float], workers: list[WorkerProfile]) -> float:
    """Min over all m^n assignments of trajectories to workers, vectorised."""
    n, m = len(lengths), len(workers)
    L = np.asarray(lengths)
    assign = np.array(list(itertools.product(range(m), repeat=n)))  # (m^n, n)
    worst = np.zeros(len(assign))
    for w, prof in enumerate(workers):
        mine = assign == w
        size = mine.sum(axis=1)
        head = np.where(mine, L[None, :], 0.0).max(axis=1)
        worst = np.maximum(worst, np.where(size > 0, head * prof.per_token_s * prof.factor(size), 0.0))
    return float(worst.min())


lengths_st = st.lists(st.floats(1, 50_000, allow_nan=False), min_size=1, max_size=9)
increments_st = st.lists(st.floats(0, 2, allow_nan=False), min_size=9, max_size=9)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, m=st.integers(1, 4), t=st.floats(1e-3, 0.1), inc=increments_st)
def test_homogeneous_optimum_equals_brute_force(
    lengths: list[float], m: int, t: float, inc: list[float]
) -> None:
    workers = [_profile(t, inc)] * m
    want = _brute_force(lengths, workers)
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
    with pytest.raises(ValueError, match="method"):
        presorted_dp([1.0], w, method="magic")
    empty = presorted_dp([], w)
    assert empty.makespan == 0.0 and empty.bounds == [(0, 0)]

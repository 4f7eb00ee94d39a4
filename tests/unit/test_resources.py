"""Sort-initialised simulated annealing against exhaustive search over model-parallel allocations."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.bench.workloads import profile, swe_lengths
from loom.policies.partition import WorkerProfile, presorted_dp, realised_makespans
from loom.policies.resources import (
    ResourceProblem,
    anneal,
    count_states,
    exhaustive,
    fixed,
    representable,
    worse_share_mean,
)


def _profiles(comm: float, contention: float) -> dict[int, WorkerProfile]:
    """Per-token time falls sublinearly with the degree (all-reduce cost), interference grows with the
    group and is milder at higher degrees (more KV room and compute per sequence)."""
    out = {}
    for d in (1, 2, 4, 8):
        g = np.arange(3001, dtype=float)
        f = 1 + contention * (g - 1) / d
        f[0] = 0.0
        out[d] = WorkerProfile(0.012 / d + comm * (d > 1), f)
    return out


@settings(max_examples=25, deadline=None)
@given(
    gpus=st.sampled_from([4, 8, 12, 16]),
    n=st.integers(20, 300),
    comm=st.floats(0.0, 0.004),
    contention=st.floats(0.0, 0.05),
    seed=st.integers(0, 10_000),
)
def test_annealing_is_within_two_percent_of_exhaustive(
    gpus: int, n: int, comm: float, contention: float, seed: int
) -> None:
    lengths = np.random.default_rng(seed).lognormal(9, 1.2, n)
    profiles = _profiles(comm, contention)
    best = exhaustive(ResourceProblem(lengths, gpus, profiles))
    got = anneal(ResourceProblem(lengths, gpus, profiles), seed=seed)
    assert sum(got.degrees) == gpus and list(got.degrees) == sorted(got.degrees, reverse=True)
    assert got.makespan <= best.makespan * 1.02
    assert got.makespan >= best.makespan * (1 - 1e-9)


def test_neighbours_keep_the_budget_and_allowed_degrees() -> None:
    problem = ResourceProblem(np.ones(10), 24, _profiles(0.001, 0.01))
    rng = random.Random(0)
    state = problem.random_state(rng)
    for _ in range(500):
        nxt = problem.neighbour(state, rng)
        assert nxt is not None
        assert sum(nxt) == 24 and set(nxt) <= {1, 2, 4, 8}
        state = nxt


def test_adaptive_beats_or_matches_both_fixed_baselines() -> None:
    lengths = np.random.default_rng(7).lognormal(9, 1.5, 400)
    problem = ResourceProblem(lengths, 32, _profiles(0.0015, 0.03))
    got = anneal(problem, seed=1)
    assert got.makespan <= fixed(problem, 1).makespan
    assert got.makespan <= fixed(problem, 8).makespan


def test_state_space_and_bad_input() -> None:
    assert count_states(8, [1, 2, 4, 8]) == 10
    with pytest.raises(ValueError, match="cannot be split"):
        ResourceProblem(np.ones(3), 3, {2: _profiles(0, 0)[2]})
    with pytest.raises(ValueError, match="at least one GPU"):
        ResourceProblem(np.ones(3), 0, _profiles(0, 0))
    with pytest.raises(ValueError, match="cannot all run"):
        fixed(ResourceProblem(np.ones(3), 12, _profiles(0, 0)), 8)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(5, 200),
    degrees=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=6),
    contention=st.floats(0.0, 0.05),
    seed=st.integers(0, 10_000),
)
def test_exact_factors_realise_the_partitions_own_makespan(
    n: int, degrees: list[int], contention: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(8, 1.0, n)
    profiles = _profiles(0.001, contention)
    workers = [profiles[d] for d in degrees]
    weights = rng.uniform(0.5, 3, n)
    prefill = rng.uniform(0, 5000, n)
    tool = lengths * 0.01  # nonincreasing down the sorted order, as the DP's tail assumes
    part = presorted_dp(lengths, workers, weights=weights, prefill=prefill, tool=tool)
    got = realised_makespans(part, workers, lengths, np.ones((3, n)), weights, prefill, tool)
    np.testing.assert_allclose(got, part.makespan, rtol=1e-9)
    # Longer actual lengths never finish sooner.
    longer = realised_makespans(part, workers, lengths, rng.uniform(1, 2, (3, n)), weights, prefill, tool)
    assert np.all(longer >= part.makespan * (1 - 1e-9))


@settings(max_examples=15, deadline=None)
@given(
    gpus=st.sampled_from([8, 16]),
    log_sd=st.floats(0.1, 1.5),
    contention=st.floats(0.0, 0.05),
    seed=st.integers(0, 10_000),
)
def test_priced_at_the_prediction_error_annealing_never_loses_to_a_fixed_degree(
    gpus: int, log_sd: float, contention: float, seed: int
) -> None:
    lengths = np.random.default_rng(seed).lognormal(9, 1.2, 120)
    problem = ResourceProblem(lengths, gpus, _profiles(0.0015, contention), log_sd=log_sd, seed=seed)
    got = anneal(problem, seed=seed)
    best = exhaustive(problem)
    assert best.makespan <= got.makespan
    for d in (1, 2, 4, 8):
        assert got.makespan <= fixed(problem, d).makespan
    # The cost is the mean realised makespan of the DP's placement over the slower half of the problem's draws.
    realised = realised_makespans(
        got.partition, [problem.profiles[d] for d in got.degrees], lengths, problem.factors
    )
    assert got.makespan == pytest.approx(np.sort(realised)[len(realised) // 2 :].mean())


@given(
    makespans=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=8),
    share=st.floats(0.01, 1.0),
)
def test_the_worse_share_is_the_slowest_subset_of_its_size_on_average(
    makespans: list[float], share: float
) -> None:
    """Brute force: of every subset of ``ceil(share * n)`` draws (at least one), the slowest on average."""
    k = max(1, math.ceil(share * len(makespans)))
    brute = max(sum(c) / k for c in itertools.combinations(makespans, k))
    assert worse_share_mean(np.array(makespans), share) == pytest.approx(brute)
    with pytest.raises(ValueError):
        worse_share_mean(np.array(makespans), 0.0)


def test_the_worse_share_rounds_up_to_whole_draws() -> None:
    assert worse_share_mean(np.array([1.0, 2.0, 3.0, 4.0]), 0.5) == 3.5
    assert worse_share_mean(np.array([1.0, 2.0, 3.0, 4.0, 5.0]), 0.5) == 4.0  # the slowest 3 of 5
    assert worse_share_mean(np.array([3.0, 1.0, 2.0]), 0.01) == 3.0  # at least the slowest one
    assert worse_share_mean(np.array([3.0, 1.0, 2.0]), 1.0) == 2.0
    with pytest.raises(ValueError):
        worse_share_mean(np.array([]), 0.5)


def test_an_uninformative_predictor_keeps_the_long_trajectories_off_slow_workers() -> None:
    """Exactly predicted, the short SWE-bench trajectories go to small workers; predicted with a large
    error, the annealer prices the long ones it cannot tell apart landing there, and every worker runs at
    one degree."""
    lengths = swe_lengths(400, 0)
    profiles = {d: profile("qwen3-14b", "h100", d, 400) for d in (1, 2, 4, 8)}
    exact = anneal(ResourceProblem(lengths, 32, profiles), seed=0)
    assert len(set(exact.degrees)) > 1
    flat = np.full(400, float(np.median(lengths)))
    blind = anneal(ResourceProblem(flat, 32, profiles, log_sd=1.0), seed=0)
    assert len(set(blind.degrees)) == 1


@given(total=st.integers(-3, 60), degrees=st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=3))
def test_a_budget_splits_into_degrees_exactly_when_brute_force_finds_a_split(
    total: int, degrees: list[int]
) -> None:
    d = tuple(sorted(set(degrees)))
    brute = total >= 0 and any(
        sum(k * x for k, x in zip(counts, d, strict=True)) == total
        for counts in itertools.product(*(range(total // x + 1) for x in d))
    )
    assert representable(total, d) == brute


def test_a_cluster_of_hundreds_of_gpus_is_split_and_sampled() -> None:
    # loom plan sweeps to twice the cluster: 512 GPUs of degree 1 once ran past Python's recursion depth.
    problem = ResourceProblem(np.ones(4), 512, _profiles(0.001, 0.01))
    state = problem.random_state(random.Random(0))
    assert sum(state) == 512 and set(state) <= {1, 2, 4, 8}

"""Sort-initialised simulated annealing against exhaustive search over model-parallel allocations."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.policies.partition import WorkerProfile
from loom.policies.resources import ResourceProblem, anneal, count_states, exhaustive, fixed


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

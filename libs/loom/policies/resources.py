"""Trajectory-adaptive resource allocation (Heddle §6.2, Algorithm 2): sort-initialised simulated annealing
over the model-parallel degrees of the workers, with the presorted DP as the evaluator.

A state is a multiset of degrees summing to the GPU budget, kept sorted in descending order so that the
longest partitions map to the highest degrees. Moves: split (d -> d/2 + d/2), merge (d + d -> 2d) and
redistribute (move k GPUs from one worker to another, both ending on allowed degrees). Evaluations are
memoised per state: annealing revisits states often, and each costs one DP.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from loom.policies.partition import Partition, WorkerProfile, presorted_dp

State = tuple[int, ...]


@dataclass(frozen=True)
class Allocation:
    degrees: State  # descending
    partition: Partition
    makespan: float
    evaluations: int
    iterations: int


class ResourceProblem:
    def __init__(
        self,
        lengths: Sequence[float] | NDArray[np.float64],
        gpus: int,
        profiles: Mapping[int, WorkerProfile],
        max_items: int | None = 512,
        weights: Sequence[float] | NDArray[np.float64] | None = None,
        prefill: Sequence[float] | NDArray[np.float64] | None = None,
        tool: Sequence[float] | NDArray[np.float64] | None = None,
    ) -> None:
        if gpus < 1:
            raise ValueError("need at least one GPU")
        if not profiles:
            raise ValueError("no model-parallel degrees allowed")
        self.lengths = np.asarray(lengths, dtype=np.float64)
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        self.prefill = None if prefill is None else np.asarray(prefill, dtype=np.float64)
        self.tool = None if tool is None else np.asarray(tool, dtype=np.float64)
        self.gpus = gpus
        self.profiles = dict(profiles)
        self.degrees = sorted(self.profiles)
        self.max_items = max_items
        self._cache: dict[State, Partition] = {}
        if not _representable(gpus, tuple(self.degrees)):
            raise ValueError(f"{gpus} GPUs cannot be split into degrees {self.degrees}")

    def evaluate(self, state: State) -> Partition:
        p = self._cache.get(state)
        if p is None:
            workers = [self.profiles[d] for d in state]
            p = self._cache[state] = presorted_dp(
                self.lengths,
                workers,
                max_items=self.max_items,
                weights=self.weights,
                prefill=self.prefill,
                tool=self.tool,
            )
        return p

    @property
    def evaluations(self) -> int:
        return len(self._cache)

    def random_state(self, rng: random.Random) -> State:
        """Sample degrees until the budget is met exactly (Algorithm 2, line 1), sorted descending."""
        while True:
            left, out = self.gpus, []
            while left > 0:
                fits = [
                    d for d in self.degrees if d <= left and _representable(left - d, tuple(self.degrees))
                ]
                d = rng.choice(fits)
                out.append(d)
                left -= d
            return tuple(sorted(out, reverse=True))

    def neighbour(self, state: State, rng: random.Random) -> State | None:
        moves = [self._split, self._merge, self._redistribute]
        rng.shuffle(moves)
        for move in moves:
            nxt = move(list(state), rng)
            if nxt is not None and nxt != state:
                return nxt
        return None

    def _split(self, s: list[int], rng: random.Random) -> State | None:
        options = [i for i, d in enumerate(s) if d % 2 == 0 and d // 2 in self.profiles]
        if not options:
            return None
        i = rng.choice(options)
        half = s.pop(i) // 2
        return tuple(sorted([*s, half, half], reverse=True))

    def _merge(self, s: list[int], rng: random.Random) -> State | None:
        pairs = [(i, j) for i in range(len(s)) for j in range(i + 1, len(s)) if s[i] + s[j] in self.profiles]
        if not pairs:
            return None
        i, j = rng.choice(pairs)
        merged = s[i] + s[j]
        rest = [d for k, d in enumerate(s) if k not in (i, j)]
        return tuple(sorted([*rest, merged], reverse=True))

    def _redistribute(self, s: list[int], rng: random.Random) -> State | None:
        moves = [
            (i, j, k)
            for i in range(len(s))
            for j in range(len(s))
            if i != j
            for k in range(1, s[i])
            if s[i] - k in self.profiles and s[j] + k in self.profiles
        ]
        if not moves:
            return None
        i, j, k = rng.choice(moves)
        s[i] -= k
        s[j] += k
        return tuple(sorted(s, reverse=True))


def anneal(
    problem: ResourceProblem,
    seed: int = 0,
    cooling: float = 0.97,
    threshold: float = 1e-3,
    restarts: int = 1,
) -> Allocation:
    """Algorithm 2. The temperature starts at the initial makespan and cools geometrically until it falls
    below ``threshold`` times that makespan; the best state seen is returned."""
    rng = random.Random(seed)
    best_state: State | None = None
    best = math.inf
    iterations = 0
    for _ in range(restarts):
        state = problem.random_state(rng)
        cost = problem.evaluate(state).makespan
        temp = cost
        floor = threshold * cost
        if cost < best:
            best, best_state = cost, state
        while temp > floor:
            iterations += 1
            nxt = problem.neighbour(state, rng)
            if nxt is not None:
                c = problem.evaluate(nxt).makespan
                delta = c - cost
                if delta < 0 or rng.random() < math.exp(-delta / temp):
                    state, cost = nxt, c
                    if cost < best:
                        best, best_state = cost, state
            temp *= cooling
    assert best_state is not None
    part = problem.evaluate(best_state)
    return Allocation(best_state, part, part.makespan, problem.evaluations, iterations)


def exhaustive(problem: ResourceProblem) -> Allocation:
    """Every multiset of allowed degrees summing to the budget: the optimum the annealer is judged by."""
    states = list(_multisets(problem.gpus, tuple(sorted(problem.degrees, reverse=True))))
    best = min(states, key=lambda st: problem.evaluate(st).makespan)
    part = problem.evaluate(best)
    return Allocation(best, part, part.makespan, problem.evaluations, len(states))


def fixed(problem: ResourceProblem, degree: int) -> Allocation:
    """The homogeneous baseline: every worker at one degree (Heddle's Fix-1 / Fix-8)."""
    if problem.gpus % degree or degree not in problem.profiles:
        raise ValueError(f"{problem.gpus} GPUs cannot all run at degree {degree}")
    state = (degree,) * (problem.gpus // degree)
    part = problem.evaluate(state)
    return Allocation(state, part, part.makespan, problem.evaluations, 0)


def count_states(gpus: int, degrees: Sequence[int]) -> int:
    return sum(1 for _ in _multisets(gpus, tuple(sorted(degrees, reverse=True))))


def _multisets(total: int, degrees: tuple[int, ...]) -> Iterator[State]:
    if total == 0:
        yield ()
        return
    for i, d in enumerate(degrees):
        if d <= total:
            for rest in _multisets(total - d, degrees[i:]):
                yield (d, *rest)


@lru_cache(maxsize=4096)
def _representable(total: int, degrees: tuple[int, ...]) -> bool:
    if total == 0:
        return True
    return any(d <= total and _representable(total - d, degrees) for d in degrees)

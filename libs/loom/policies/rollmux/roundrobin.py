"""The intra-group schedule: a round robin of phases (paper §4.3) and long-tail migration.

Within a meta-iteration every member runs exactly one rollout and one training phase; each rollout node and
the training pool serve their members in a fixed cyclic order. ``meta_period`` computes the steady-state
meta-iteration of that order (the inter-group scheduler's SLO check); ``RoundRobinExecutor`` is the same
order as a live state machine that grants phase permits as phases report done (the scheduler service).
For an unsaturated group both give the longest member's solo cycle (Theorem 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

ROLLOUT = "rollout"
TRAIN = "train"
PHASES = (ROLLOUT, TRAIN)
TRAIN_POOL = -1  # the resource id of the training pool; rollout nodes are 0, 1, ...


class Phase(NamedTuple):
    nodes: tuple[int, ...]
    roll: float
    train: float


def round_robin_ends(phases: Sequence[Phase], iterations: int) -> list[float]:
    """When each meta-iteration's last training ends under the strict round robin over ``phases``.

    A max-plus recurrence: job k's rollout in iteration i starts when its training of iteration i-1 and
    the previous rollout on each of its nodes are done; its training when its rollout and the previous
    training are.
    """
    node_free: dict[int, float] = {}
    train_free = 0.0
    train_end = [0.0] * len(phases)
    ends = []
    for _ in range(iterations):
        for k, (nodes, roll, train) in enumerate(phases):
            start = train_end[k]
            for n in nodes:
                f = node_free.get(n, 0.0)
                if f > start:
                    start = f
            end = start + roll
            for n in nodes:
                node_free[n] = end
            train_free = (end if end > train_free else train_free) + train
            train_end[k] = train_free
        ends.append(train_free)
    return ends


def meta_period(phases: Sequence[Phase], iterations: int = 24) -> float:
    """Steady-state meta-iteration time of the strict round robin over ``phases`` (in order).

    The mean of the second half of ``iterations``, past the start-up transient, and never below what any
    schedule needs: the longest member's cycle and the bottleneck's work (a transient that has not died
    out yet can average lower).
    """
    if not phases:
        return 0.0
    ends = round_robin_ends(phases, iterations)
    half = iterations // 2
    mean = (ends[-1] - ends[half - 1]) / (iterations - half)
    return max(mean, *cycle_and_load(phases))


def cycle_and_load(phases: Sequence[Phase]) -> tuple[float, float]:
    """T_cycle (the longest member's iteration) and T_load (one meta-iteration's work on the bottleneck:
    the training pool or the busiest rollout node), paper §4.2."""
    per_node: dict[int, float] = {}
    for p in phases:
        for n in p.nodes:
            per_node[n] = per_node.get(n, 0.0) + p.roll
    cycle = max((p.roll + p.train for p in phases), default=0.0)
    return cycle, max(sum(p.train for p in phases), max(per_node.values(), default=0.0))


@dataclass(frozen=True)
class Permit:
    job: str
    phase: str
    nodes: tuple[int, ...]  # rollout nodes, or (TRAIN_POOL,)
    gpus: dict[int, int]  # GPUs granted per node


@dataclass(frozen=True)
class Migration:
    """Consolidate a rollout's remaining responses onto ``gpus`` GPUs of ``node``; the rest is freed."""

    job: str
    node: int
    gpus: int


def tail_gpus(done_fraction: float, gpus: int, threshold: float = 0.8) -> int | None:
    """How many GPUs a rollout's long tail keeps once ``threshold`` of its responses are done, or None.

    The remaining responses keep the per-GPU share they had (their fraction of the GPUs, at least one):
    with 80% done, 20% of the GPUs carry the tail and 80% go to the next job's rollout (paper §4.3).
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError("the migration threshold is a fraction in (0, 1]")
    if done_fraction < threshold or done_fraction >= 1.0:
        return None
    keep = max(1, math.ceil(gpus * (1.0 - done_fraction) - 1e-9))
    return keep if keep < gpus else None


@dataclass
class _Resource:
    order: list[str] = field(default_factory=list)
    turn: int = 0
    holder: str | None = None
    tail: dict[str, int] = field(default_factory=dict)  # migrated long tails: job -> GPUs kept

    def whose_turn(self) -> str | None:
        return self.order[self.turn % len(self.order)] if self.order else None

    def advance(self) -> None:
        if self.order:
            self.turn = (self.turn + 1) % len(self.order)


class RoundRobinExecutor:
    """Phase permits for one co-execution group, in strict round-robin order per resource.

    A phase starts when it is its job's turn on every resource it needs and they are free; a finished
    phase passes the turn on. A rollout with ``threshold`` of its responses done is migrated: its tail
    keeps a few GPUs of one node and the turn passes at once, so the next rollout starts on the rest.
    """

    def __init__(self, gpus_per_node: int = 8, threshold: float = 0.8) -> None:
        self.gpus_per_node = gpus_per_node
        self.threshold = threshold
        self.nodes: dict[str, tuple[int, ...]] = {}
        self.resources: dict[int, _Resource] = {TRAIN_POOL: _Resource()}
        self.waiting: dict[str, str] = {}  # job -> phase it asked for
        self.running: dict[str, str] = {}  # job -> phase holding its resources
        self.migrated: set[str] = set()

    # ---------------------------------------------------------------- membership

    def add(self, job: str, nodes: tuple[int, ...]) -> None:
        if job in self.nodes:
            raise ValueError(f"job {job!r} is already in this group")
        if not nodes:
            raise ValueError("a job needs at least one rollout node")
        self.nodes[job] = nodes
        for r in (TRAIN_POOL, *nodes):
            self.resources.setdefault(r, _Resource()).order.append(job)

    def remove(self, job: str) -> list[Permit]:
        """Take a job out (it finished or was cancelled); its resources and turns pass on."""
        nodes = self.nodes.pop(job)
        self.waiting.pop(job, None)
        self.running.pop(job, None)
        self.migrated.discard(job)
        for r in (TRAIN_POOL, *nodes):
            res = self.resources[r]
            i = res.order.index(job)
            res.order.pop(i)
            res.tail.pop(job, None)
            if res.holder == job:
                res.holder = None
            if i < res.turn or res.turn >= len(res.order):
                res.turn = res.turn - 1 if i < res.turn else 0
            if not res.order and r != TRAIN_POOL:
                del self.resources[r]
        return self._grant()

    # ---------------------------------------------------------------- phase lifecycle

    def request(self, job: str, phase: str) -> list[Permit]:
        """``job`` wants to run ``phase``; returns the permits this makes possible (maybe its own)."""
        if job not in self.nodes:
            raise KeyError(f"job {job!r} is not in this group")
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, not {phase!r}")
        if job in self.running or job in self.waiting:
            raise ValueError(f"job {job!r} already holds or waits for a phase")
        self.waiting[job] = phase
        return self._grant()

    def done(self, job: str, phase: str) -> list[Permit]:
        """``job`` finished ``phase``; returns the permits that now start."""
        if self.running.get(job) != phase and not (phase == ROLLOUT and job in self.migrated):
            raise ValueError(f"job {job!r} does not hold a {phase} permit")
        if job in self.migrated:
            self.migrated.discard(job)
            for n in self.nodes[job]:
                self.resources[n].tail.pop(job, None)
        else:
            for r in self._resources(job, phase):
                res = self.resources[r]
                res.holder = None
                res.advance()
        self.running.pop(job, None)
        return self._grant()

    def progress(self, job: str, done_fraction: float) -> tuple[Migration | None, list[Permit]]:
        """A running rollout reports the share of its responses done; migrate its tail past the threshold."""
        if self.running.get(job) != ROLLOUT or job in self.migrated:
            return None, []
        keep = tail_gpus(done_fraction, self.gpus_per_node * len(self.nodes[job]), self.threshold)
        if keep is None or keep > self.gpus_per_node:
            return None, []
        node = self.nodes[job][0]
        self.migrated.add(job)
        for n in self.nodes[job]:
            res = self.resources[n]
            res.holder = None
            res.advance()
        self.resources[node].tail[job] = keep
        return Migration(job, node, keep), self._grant()

    # ---------------------------------------------------------------- internals

    def _resources(self, job: str, phase: str) -> tuple[int, ...]:
        return (TRAIN_POOL,) if phase == TRAIN else self.nodes[job]

    def _grant(self) -> list[Permit]:
        granted = []
        for job, phase in list(self.waiting.items()):
            rs = self._resources(job, phase)
            if all(self.resources[r].holder is None and self.resources[r].whose_turn() == job for r in rs):
                for r in rs:
                    self.resources[r].holder = job
                del self.waiting[job]
                self.running[job] = phase
                gpus = {
                    r: self.gpus_per_node - sum(self.resources[r].tail.values())
                    for r in rs
                    if r != TRAIN_POOL
                }
                granted.append(Permit(job, phase, rs, gpus))
        return granted

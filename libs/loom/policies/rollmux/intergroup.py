"""Inter-group scheduling: which co-execution group an arriving job joins, and on which rollout nodes.

``RollMux`` is the paper's Algorithm 1: skip saturated groups, try direct packing (existing rollout nodes)
and rollout scaling (some new rollout nodes) in every other group, drop placements that break memory
residency or any member's SLO (checked on the simulated round robin), keep the one with the least marginal
cost, and fall back to an isolated group. Where the paper leaves ties open (several placements adding
nothing), Loom takes the best fit, the placement that leaves its group the least slack, so that loose groups
stay open for later jobs. Baselines from the paper's §7.5: solo disaggregation, random, most-idle.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.group import EPS, Group, Member
from loom.policies.rollmux.job import RLJob

DIRECT, SCALING, ISOLATED = "direct", "scaling", "isolated"


@dataclass(frozen=True)
class Decision:
    group: int | None  # None: provision a new, isolated group
    nodes: tuple[int, ...]  # rollout nodes the job is pinned to (ids past the group's are new nodes)
    delta: float  # marginal provisioning cost, $/h
    strategy: str
    period: float  # the group's meta-iteration after admission (the job's co-execution iteration)


class Policy(Protocol):
    name: str

    def place(self, state: CoScheduler, job: RLJob) -> Decision: ...


class CoScheduler:
    """The cluster's groups and the job -> group map; a policy decides, this applies."""

    def __init__(self, cluster: ClusterSpec, policy: Policy) -> None:
        self.cluster = cluster
        self.policy = policy
        self.groups: dict[int, Group] = {}
        self.where: dict[str, int] = {}
        self._next_group = 0

    def submit(self, job: RLJob) -> Decision:
        if job.id in self.where:
            raise ValueError(f"job {job.id!r} is already placed")
        d = self.policy.place(self, job)
        self.apply(job, d)
        return d

    def apply(self, job: RLJob, d: Decision) -> Group:
        if d.group is None:
            g = Group(self._next_group, job.train_nodes, self.cluster)
            self._next_group += 1
            self.groups[g.id] = g
        else:
            g = self.groups[d.group]
        g.add(job, d.nodes)
        self.where[job.id] = g.id
        return g

    def depart(self, job_id: str) -> Group:
        g = self.groups[self.where.pop(job_id)]
        g.remove(job_id)
        if not g.members:
            del self.groups[g.id]
        return g

    def isolated(self, job: RLJob) -> Decision:
        """A new group on exactly the job's own request (Algorithm 1, line 15)."""
        return Decision(
            None,
            tuple(range(job.roll_nodes)),
            self.cluster.cost(job.roll_nodes, job.train_nodes),
            ISOLATED,
            job.t_solo,
        )

    def cost(self) -> float:
        return sum(g.cost() for g in self.groups.values())

    def gpus(self) -> tuple[int, int]:
        """(rollout GPUs, training GPUs) provisioned."""
        n = self.cluster.gpus_per_node
        return (
            n * sum(len(g.nodes) for g in self.groups.values()),
            n * sum(g.train_nodes for g in self.groups.values()),
        )


# Direct packings GENERATEPLACEMENTS enumerates at most.
MAX_DIRECT = 256


def _by_load(g: Group) -> list[int]:
    load = {n: sum(g.members[j].job.t_roll for j in js) for n, js in g.nodes.items()}
    return sorted(g.nodes, key=lambda n: (load[n], n))


def placements(g: Group, job: RLJob) -> Iterator[tuple[tuple[int, ...], int]]:
    """GENERATEPLACEMENTS: (rollout nodes, how many of them are new) for ``job`` in ``g``."""
    r = job.roll_nodes
    ranked = _by_load(g)
    # Direct packing onto existing nodes: every choice among the r + 4 least loaded while there are few
    # (C(r + 4, 4) grows as r^4: at r = 540 it was billions, and a registration never returned), else the
    # r least loaded alone.
    if math.comb(min(len(ranked), r + 4), r) <= MAX_DIRECT:
        for combo in itertools.combinations(ranked[: r + 4], r):
            yield tuple(sorted(combo)), 0
    elif len(ranked) >= r:
        yield tuple(sorted(ranked[:r])), 0
    # Rollout scaling: k new nodes, the rest on the least loaded existing ones.
    for k in range(1, r + 1):
        if r - k <= len(ranked):
            yield tuple(sorted(ranked[: r - k])) + g.new_nodes(k), k


class RollMux:
    name = "loom"

    def place(self, state: CoScheduler, job: RLJob) -> Decision:
        best = state.isolated(job)
        best_slack = float("inf")
        roll_cost = state.cluster.roll_node_cost()
        cap = state.cluster.max_group_size
        for g in state.groups.values():
            if len(g.members) >= cap or g.saturated():
                continue
            # Necessary conditions before any simulation: the meta-iteration is at least the new
            # cycle and the whole training work, and must fit every member's budget.
            t_train = g.t_train(job, True)
            budget = min(g.min_budget, job.budget)
            if max(g.t_cycle, job.t_roll + t_train, g.train_sum + t_train) > budget + EPS:
                continue
            if job.train_mem > g.train_mem_free() + EPS:
                continue
            for nodes, new in placements(g, job):
                delta = new * roll_cost
                if delta > best.delta + EPS or not g.fits(job, nodes):
                    continue
                period = g.period(Member(job, nodes))
                if period > budget + EPS:
                    continue
                slack = budget - period
                if delta < best.delta - EPS or slack < best_slack:
                    best = Decision(g.id, nodes, delta, SCALING if new else DIRECT, period)
                    best_slack = slack
        return best


class SoloDisaggregation:
    """Every job on dedicated rollout and training nodes (1:1), the usual practice."""

    name = "solo"

    def place(self, state: CoScheduler, job: RLJob) -> Decision:
        return state.isolated(job)


def _fitting(g: Group, job: RLJob, cap: int) -> list[tuple[int, ...]]:
    if len(g.members) >= cap or len(g.nodes) < job.roll_nodes:
        return []
    return [c for c in itertools.combinations(sorted(g.nodes), job.roll_nodes) if g.fits(job, c)]


class RandomPlacement:
    """A random group that can hold the job (memory, group size) or a new one; random nodes in it."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def place(self, state: CoScheduler, job: RLJob) -> Decision:
        cap = state.cluster.max_group_size
        options = [(g, f) for g in state.groups.values() if (f := _fitting(g, job, cap))]
        pick = self.rng.randrange(len(options) + 1)
        if pick == len(options):
            return state.isolated(job)
        g, fits = options[pick]
        nodes = self.rng.choice(fits)
        return Decision(g.id, nodes, 0.0, DIRECT, g.period(Member(job, nodes)))


class MostIdle:
    """The group with the largest idle share that can hold the job, on its least loaded nodes."""

    name = "most_idle"

    def place(self, state: CoScheduler, job: RLJob) -> Decision:
        cap = state.cluster.max_group_size
        best: tuple[float, Group, tuple[int, ...]] | None = None
        for g in state.groups.values():
            if len(g.members) >= cap or len(g.nodes) < job.roll_nodes:
                continue
            nodes = tuple(n for n in _by_load(g) if g.fits(job, (n,)))[: job.roll_nodes]
            if len(nodes) < job.roll_nodes or not g.fits(job, nodes):
                continue
            idle = 1.0 - g.utilisation()
            if best is None or idle > best[0]:
                best = (idle, g, tuple(sorted(nodes)))
        if best is None:
            return state.isolated(job)
        _, g, nodes = best
        return Decision(g.id, nodes, 0.0, DIRECT, g.period(Member(job, nodes)))

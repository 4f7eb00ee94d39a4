"""The offline optimum on small instances, by brute force (the paper's "Opt" baseline, §7.5).

Every partition of the jobs into groups of at most ``max_group_size``, and for every group every training
pool size, every pinning of the jobs onto rollout nodes (up to relabelling nodes) and every round-robin
order (up to rotation, which leaves the steady state unchanged). A group's cheapest feasible configuration is
found by trying pool sizes in order of cost; the partition by dynamic programming over subsets, which is
exact because groups share nothing. Exponential: meant for about ten jobs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from functools import cache

from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.group import EPS
from loom.policies.rollmux.job import RLJob
from loom.policies.rollmux.roundrobin import Phase, meta_period


def _pinnings(jobs: Sequence[RLJob], r_total: int, cluster: ClusterSpec) -> Iterator[list[tuple[int, ...]]]:
    """Pinnings of each job onto exactly ``r_total`` rollout nodes, new nodes numbered in order of use."""
    mem = [0.0] * r_total
    cap = cluster.roll_node_mem_gb

    def rec(i: int, used: int, acc: list[tuple[int, ...]]) -> Iterator[list[tuple[int, ...]]]:
        if i == len(jobs):
            if used == r_total:
                yield list(acc)
            return
        j = jobs[i]
        for new in range(0, min(j.roll_nodes, r_total - used) + 1):
            for old in itertools.combinations(range(used), j.roll_nodes - new):
                nodes = old + tuple(range(used, used + new))
                if any(mem[n] + j.roll_mem > cap + EPS for n in nodes):
                    continue
                for n in nodes:
                    mem[n] += j.roll_mem
                acc.append(nodes)
                yield from rec(i + 1, used + new, acc)
                acc.pop()
                for n in nodes:
                    mem[n] -= j.roll_mem

    yield from rec(0, 0, [])


def best_group(jobs: Sequence[RLJob], cluster: ClusterSpec) -> float:
    """Cheapest $/h of one group holding exactly ``jobs`` with every SLO met; inf when none exists."""
    n = len(jobs)
    if n > cluster.max_group_size or sum(j.train_mem for j in jobs) > cluster.train_node_mem_gb + EPS:
        return float("inf")
    budget = min(j.budget for j in jobs)
    warm = cluster.warm_start and n > 1
    sizes = sorted(
        itertools.product(
            range(max(j.roll_nodes for j in jobs), sum(j.roll_nodes for j in jobs) + 1),
            sorted({j.train_nodes for j in jobs}),
        ),
        key=lambda rt: cluster.cost(*rt),
    )
    for r_total, t_nodes in sizes:
        train = [j.t_train * j.train_nodes / t_nodes + (j.train_warm if warm else 0.0) for j in jobs]
        if (
            sum(train) > budget + EPS
            or max(j.t_roll + t for j, t in zip(jobs, train, strict=True)) > budget + EPS
        ):
            continue
        for pins in _pinnings(jobs, r_total, cluster):
            count = [0] * r_total
            for ns in pins:
                for x in ns:
                    count[x] += 1
            phases = [
                Phase(ns, j.t_roll + (j.roll_warm if warm and any(count[x] > 1 for x in ns) else 0.0), t)
                for j, ns, t in zip(jobs, pins, train, strict=True)
            ]
            for rest in itertools.permutations(range(1, n)):
                if meta_period([phases[0], *(phases[i] for i in rest)]) <= budget + EPS:
                    return cluster.cost(r_total, t_nodes)
    return float("inf")


def optimal_cost(jobs: Sequence[RLJob], cluster: ClusterSpec) -> float:
    """Least total $/h over all groupings of ``jobs`` (all resident at once) meeting every constraint."""
    n = len(jobs)
    group_cost: dict[int, float] = {}
    for mask in range(1, 1 << n):
        members = [jobs[i] for i in range(n) if mask >> i & 1]
        if len(members) <= cluster.max_group_size:
            group_cost[mask] = best_group(members, cluster)

    @cache
    def opt(mask: int) -> float:
        if mask == 0:
            return 0.0
        low = mask & -mask
        best = float("inf")
        sub = mask
        while sub:
            if sub & low and sub in group_cost:
                best = min(best, group_cost[sub] + opt(mask ^ sub))
            sub = (sub - 1) & mask
        return best

    return opt((1 << n) - 1)

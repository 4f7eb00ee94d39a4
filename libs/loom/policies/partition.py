"""Presorted dynamic programming placement (Heddle §5.2, Formula 3).

Trajectories sorted by descending predicted length are cut into contiguous groups, group j going to
worker j, with workers sorted fastest first (highest model parallelism first, Heddle §6.2). A group's
time is ``L(first) * T_j * F_j(size)``: its longest trajectory, the worker's base per-token time and the
worker's interference factor at that group size. The makespan is the slowest group's time.

Two exact solvers of the same problem (groups may be empty: workers may idle):

- ``dp``: Formula 3, dp[i][j] = min_k max(dp[k][j-1], L(k+1) T F(k+1..i)). For fixed (i, j) the first term
  is nondecreasing in k and the second nonincreasing (F is monotone), so the inner minimum sits where they
  cross, found by a binary search vectorised over all i: O(m n log n) numpy work, not O(m n^2).
- ``parametric`` (default): for a target makespan C, filling workers in order, each with the longest
  prefix of what is left that fits C, succeeds iff any contiguous partition meets C (shrinking a group
  from the front only lowers its head and its size). Each fill is one binary search in the monotone F
  table, so a geometric bisection on C costs O(m log n) per probe; it stops when the best feasible
  makespan found is within 1e-12 of an infeasible target, i.e. at the optimum. About 1 ms at n = 6400.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class WorkerProfile:
    """What the placement needs to know of a worker: base per-token time (batch 1) and the
    interference factor F[g] for a group of g trajectories (F[1] = 1, nondecreasing)."""

    per_token_s: float
    interference: NDArray[np.float64]

    def factor(self, sizes: NDArray[np.int64]) -> NDArray[np.float64]:
        f = self.interference
        last = len(f) - 1
        # Beyond the table, extend linearly with the table's last slope (F keeps growing with load).
        slope = f[last] - f[last - 1] if last >= 1 else 0.0
        inside = f[np.minimum(sizes, last)]
        return np.where(sizes > last, f[last] + slope * (sizes - last), inside)


@dataclass(frozen=True)
class Partition:
    order: NDArray[np.int64]  # trajectory indices, longest first
    bounds: list[tuple[int, int]]  # per worker (in the caller's worker order): [start, end) into ``order``
    group_times: list[float]  # per worker, same order
    makespan: float
    group_order: list[int]  # worker indices from the longest group to the shortest (fastest first)

    def assignment(self) -> NDArray[np.int64]:
        """worker index for every trajectory (input order)."""
        out = np.empty(len(self.order), dtype=np.int64)
        for w, (a, b) in enumerate(self.bounds):
            out[self.order[a:b]] = w
        return out


def presorted_dp(
    lengths: Sequence[float] | NDArray[np.float64],
    workers: Sequence[WorkerProfile],
    max_items: int | None = None,
    method: str = "parametric",
) -> Partition:
    """Optimal contiguous partition of trajectories sorted by length onto workers sorted by speed.

    ``max_items`` aggregates the shortest trajectories into equal-count chunks when there are more than
    that many (Heddle's aggregation of short trajectories below a threshold): boundaries among the short
    tail become coarser, the long head stays exact. ``None`` disables it.
    """
    lens = np.asarray(lengths, dtype=np.float64)
    m = len(workers)
    if m == 0:
        raise ValueError("no workers")
    if np.any(lens < 0) or not np.all(np.isfinite(lens)):
        raise ValueError("lengths must be finite and non-negative")
    order = np.argsort(-lens, kind="stable")
    sorted_lens = lens[order]
    wsort = sorted(range(m), key=lambda w: workers[w].per_token_s)
    heads, counts = _aggregate(sorted_lens, max_items)
    ordered = [workers[w] for w in wsort]
    if method == "parametric":
        cuts = _solve_parametric(heads, counts, ordered)
    elif method == "dp":
        cuts = _solve_dp(heads, counts, ordered)
    else:
        raise ValueError(f"unknown method {method!r}")
    item_start = np.concatenate([[0], np.cumsum(counts)])
    bounds: list[tuple[int, int]] = [(0, 0)] * m
    times = [0.0] * m
    for rank, (a, b) in enumerate(cuts):
        w = wsort[rank]
        s, e = int(item_start[a]), int(item_start[b])
        bounds[w] = (s, e)
        if e > s:
            prof = workers[w]
            times[w] = float(sorted_lens[s] * prof.per_token_s * prof.factor(np.array([e - s]))[0])
    return Partition(
        order=order,
        bounds=bounds,
        group_times=times,
        makespan=max(times) if times else 0.0,
        group_order=wsort,
    )


def _aggregate(
    sorted_lens: NDArray[np.float64], max_items: int | None
) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
    n = len(sorted_lens)
    if max_items is None or n <= max_items:
        return sorted_lens, np.ones(n, dtype=np.int64)
    keep = max_items // 2
    tail = n - keep
    chunks = max_items - keep
    edges = np.linspace(keep, n, chunks + 1).round().astype(np.int64)
    edges = np.unique(edges)
    heads = np.concatenate([sorted_lens[:keep], sorted_lens[edges[:-1]]])
    counts = np.concatenate([np.ones(keep, dtype=np.int64), np.diff(edges)])
    assert counts.sum() == keep + tail
    return heads, counts


def _solve_dp(
    heads: NDArray[np.float64], counts: NDArray[np.int64], workers: Sequence[WorkerProfile]
) -> list[tuple[int, int]]:
    """Formula 3 over items (``heads`` = each item's longest length, ``counts`` = trajectories in it)."""
    n = len(heads)
    csum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    idx = np.arange(n + 1)
    head_at = np.concatenate([heads, [0.0]])  # head_at[n] is never a group's first item
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0
    choices = []
    for prof in workers:

        def cost(k: NDArray[np.int64], prof: WorkerProfile = prof) -> NDArray[np.float64]:
            size = csum[idx] - csum[k]
            return np.where(size > 0, head_at[k] * prof.per_token_s * prof.factor(size), 0.0)

        lo = np.zeros(n + 1, dtype=np.int64)
        hi = idx.copy()
        # Smallest k in [0, i] with prev[k] >= cost(k, i); cost(i, i) = 0 makes k = i always qualify.
        while True:
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) // 2
            ok = prev[mid] >= cost(mid)
            hi = np.where(active & ok, mid, hi)
            lo = np.where(active & ~ok, mid + 1, lo)
        k = lo
        at_k = prev[k]
        km1 = np.maximum(k - 1, 0)
        before = np.where(k > 0, np.maximum(prev[km1], cost(km1)), np.inf)
        take_before = before < at_k
        prev = np.where(take_before, before, at_k)
        choices.append(np.where(take_before, km1, k))
    cuts: list[tuple[int, int]] = []
    end = n
    for j in range(len(workers) - 1, -1, -1):
        start = int(choices[j][end])
        cuts.append((start, end))
        end = start
    assert end == 0
    return cuts[::-1]


def _tables(workers: Sequence[WorkerProfile], total: int) -> list[NDArray[np.float64]]:
    """Each worker's F for group sizes 0..total, with F[0] = 0 (an empty group takes no time).
    Workers usually share a few profiles (one per model-parallel size): build each table once."""
    built: dict[int, NDArray[np.float64]] = {}
    out = []
    for prof in workers:
        f = built.get(id(prof))
        if f is None:
            f = prof.factor(np.arange(total + 1, dtype=np.int64)).astype(np.float64)
            f[0] = 0.0
            if np.any(f[2:] < f[1:-1]):
                raise ValueError("interference factor must be nondecreasing in group size")
            built[id(prof)] = f
        out.append(f)
    return out


# Targets probed at once: each round narrows the bracket around the optimum by this factor (in log space).
PROBES = 256


def _solve_parametric(
    heads: NDArray[np.float64], counts: NDArray[np.int64], workers: Sequence[WorkerProfile]
) -> list[tuple[int, int]]:
    n, m = len(heads), len(workers)
    if n == 0:
        return [(0, 0)] * m
    csum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    unit_items = bool(csum[-1] == n)  # no aggregation: item i is trajectory i, sizes are index differences
    tables = _tables(workers, int(csum[-1]))
    speeds = [p.per_token_s for p in workers]
    # Zero-length trajectories fit anywhere; a tiny head keeps every division finite. Past the end, a
    # worker with nothing left takes "everything" (nothing).
    head = np.concatenate([np.maximum(heads, 1e-300), [1e-300]])

    def fill(targets: NDArray[np.float64]) -> NDArray[np.int64]:
        """Greedy fill for every target at once: the group starts, (m+1, K); all fit where the last is n."""
        starts = np.zeros((m + 1, len(targets)), dtype=np.int64)
        start = starts[0]
        for j in range(m):
            size = np.searchsorted(tables[j], targets / (head[start] * speeds[j]), side="right") - 1
            if unit_items:
                end = np.minimum(start + size, n)
            else:
                end = np.searchsorted(csum, csum[start] + size, side="right") - 1
            starts[j + 1] = end
            start = end
        return starts

    def span(cuts: NDArray[np.int64]) -> float:
        worst = 0.0
        for j, (a, b) in enumerate(itertools.pairwise(cuts.tolist())):
            if b > a:
                worst = max(worst, heads[a] * speeds[j] * tables[j][csum[b] - csum[a]])
        return float(worst)

    lo = float(heads[0] * min(speeds))  # the longest trajectory alone on the fastest worker (F(1) = 1)
    starts = fill(np.array([lo, np.inf]))
    if starts[m, 0] == n:
        return _cuts(starts[:, 0])
    best = starts[:, 1]
    hi = span(best)
    while hi > lo * (1 + 1e-12):
        # Ascending targets, the last just below the best makespan found. Feasibility is monotone in the
        # target, so if even that one fails, the best found is optimal.
        targets = np.append(np.geomspace(lo, hi, PROBES + 1)[1:-1], hi * (1 - 1e-12))
        ok = fill(targets)
        fits = ok[m] == n
        if not fits[-1]:
            break
        i = int(np.argmax(fits))  # the smallest target that fits: its makespan is at most that target
        got = span(ok[:, i])
        if got < hi:
            best, hi = ok[:, i], got
        if i > 0:
            lo = float(targets[i - 1])
    return _cuts(best)


def _cuts(starts: NDArray[np.int64]) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in itertools.pairwise(starts)]

"""Presorted dynamic programming placement (Heddle §5.2, Formula 3).

Trajectories sorted by descending predicted length are cut into contiguous groups, group j going to
worker j, with workers sorted fastest first (highest model parallelism first, Heddle §6.2). A group's
time is ``L(first) * T_j * F_j(size)``: its longest trajectory, the worker's base per-token time and the
worker's interference factor at that group size. The makespan is the slowest group's time. A group's
size is the sum of its members' weights (1 each unless given), so trajectories that load a worker more
(longer contexts, more KV cache) count for more.

Two exact solvers of the same problem (groups may be empty: workers may idle):

- ``dp``: Formula 3, dp[i][j] = min_k max(dp[k][j-1], L(k+1) T F(k+1..i)). For fixed (i, j) the first term
  is nondecreasing in k and the second nonincreasing (F is monotone), so the inner minimum sits where they
  cross, found by a binary search vectorised over all i: O(m n log n) numpy work, not O(m n^2).
- ``parametric`` (default): for a target makespan C, filling workers in order, each with the longest
  prefix of what is left that fits C, succeeds iff any contiguous partition meets C (shrinking a group
  from the front only lowers its head and its size). Each fill inverts the monotone F table and finds the
  group's end in the cumulative weights, so a geometric bisection on C costs O(m log n) per probe; it stops when the best feasible
  makespan found is within 1e-12 of an infeasible target, i.e. at the optimum. About 1 ms at n = 6400.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class WorkerProfile:
    """What the placement needs to know of a worker: base per-token time (batch 1), the interference
    factor F[g] for a group of g trajectories (F[1] = 1, nondecreasing), and the group size at which it
    saturates (its KV cache or batch limit is full; infinite: never).

    Sizes may be fractional (a group's size is the sum of its members' weights): F is linear between
    table points, at least F[1] for any non-empty group, and extends past the table with its last slope.

    ``work_s``: seconds per weight-token once saturated, where known better than F(saturation) /
    saturation * T. ``min_weight``: the least share of the worker one trajectory takes, however short its
    context: a batch slot, when the batch limit binds before the KV cache does. ``weight_scale``: a
    trajectory's weight (its context over the reference context) in this worker's units, below 1 where
    the batch limit saturates it at the reference context and a trajectory's context is then a smaller
    share of it than of the reference batch. ``prefill_s``: seconds per prefilled token once saturated,
    what a trajectory's new input tokens add to its group's work.
    """

    per_token_s: float
    interference: NDArray[np.float64]
    saturation: float = float("inf")
    work_s: float | None = None
    min_weight: float = 0.0
    prefill_s: float = 0.0
    weight_scale: float = 1.0

    def share(self, weights: NDArray[np.float64]) -> NDArray[np.float64]:
        """Trajectories' weights in this worker's units, each at least a batch slot."""
        return np.maximum(weights * self.weight_scale, self.min_weight)

    def factor(self, sizes: NDArray[np.float64] | NDArray[np.int64]) -> NDArray[np.float64]:
        x = np.asarray(sizes, dtype=np.float64)
        g, at = self._floored, self._points
        last = len(g) - 1
        slope = g[last] - g[last - 1] if last >= 1 else 0.0
        inside = np.interp(x, at, g)
        out = np.where(x > last, g[last] + slope * (x - last), inside)
        return np.where(x > 0, out, 0.0)

    @property
    def work_rate(self) -> float:
        """Seconds per weight-token once saturated, over T: F(saturation) / saturation (0 if never)."""
        if not np.isfinite(self.saturation):
            return 0.0
        if self.work_s is not None:
            return self.work_s / self.per_token_s
        return float(self.factor(np.array([self.saturation]))[0]) / self.saturation

    def group_time(
        self, head: NDArray[np.float64], size: NDArray[np.float64], work: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """A group's makespan: its head at the interference of the batch it actually shares (a saturated
        worker queues the rest), or its total work (sum of length x weight) at the saturated rate,
        whichever is longer. Below saturation this is Formula 3's L(head) * T * F(size)."""
        shared = self.factor(np.minimum(size, self.saturation))
        t = self.per_token_s * np.maximum(head * shared, self.work_rate * work)
        return np.where(size > 0, t, 0.0)

    # Computed once per profile (the placement prices thousands of groups against one table).
    @functools.cached_property
    def _floored(self) -> NDArray[np.float64]:
        g = np.asarray(self.interference, dtype=np.float64).copy()
        if len(g) > 1:
            g[0] = g[1]  # a group smaller than one trajectory still runs at the single-trajectory rate
        return g

    @functools.cached_property
    def _points(self) -> NDArray[np.float64]:
        return np.arange(len(self._floored), dtype=np.float64)


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


def coarsen(lengths: Sequence[float], log_sd: float, slope: float = 1.0) -> list[float]:
    """Predicted lengths as far as a predictor can tell them apart: their log differences from their mean
    shrunk by ``slope`` (how much of a predicted difference is real: the slope of true on predicted log
    lengths), then each rounded to a grid of ``log_sd`` (its error) in log space. Predictions closer than
    the error then tie, and the presort deals tied trajectories out in the order given (sample-major: a
    prompt's samples spread over the groups) instead of stacking a prompt's samples, whose estimates at
    admission are alike, on one worker. An exact predictor (``log_sd`` 0, ``slope`` 1) keeps its lengths."""
    if log_sd < 0 or not 0 <= slope <= 1:
        raise ValueError("log_sd must be non-negative and slope in [0, 1]")
    if (log_sd == 0 and slope == 1) or not len(lengths):
        return [float(x) for x in lengths]
    logs = np.log(np.maximum(np.asarray(lengths, dtype=np.float64), 1.0))
    logs = logs.mean() + slope * (logs - logs.mean())
    if log_sd:
        logs = np.round(logs / log_sd) * log_sd
    return np.exp(logs).tolist()


def presorted_dp(
    lengths: Sequence[float] | NDArray[np.float64],
    workers: Sequence[WorkerProfile],
    max_items: int | None = None,
    method: str = "parametric",
    weights: Sequence[float] | NDArray[np.float64] | None = None,
    prefill: Sequence[float] | NDArray[np.float64] | None = None,
    tool: Sequence[float] | NDArray[np.float64] | None = None,
    spread: bool = False,
    slack: float = 1.0,
) -> Partition:
    """Optimal contiguous partition of trajectories sorted by length onto workers sorted by speed.

    ``weights`` measure each trajectory's share of a worker (default 1): a group's size for F is the sum
    of its weights. The harness weighs a trajectory by its mean context over the profile's reference
    context, so one that holds four times the KV cache counts as four (see ``loom.policies.profiles``).
    ``prefill``: each trajectory's input tokens to prefill (prompt and observations), which saturated
    workers charge at their ``prefill_s`` on top of the decode work.
    ``tool``: each trajectory's seconds in tool calls, which no worker shortens. A group's time adds the
    longest of them from its head on in the sorted order (at least its members' longest, and nonincreasing
    as the group's head moves down, which keeps both solvers exact): where tool time grows with length,
    a faster worker shortens the head's generation but not its tools, and the allocation weighs that.

    ``spread`` (parametric only): of the partitions within ``slack`` times the optimal makespan, one that
    loads no worker further past its saturation than it must (``_spread``): for predictions too uncertain to
    pack by. Partitions whose predicted makespans differ by less than the predictions' error are alike to
    the predictor; the harness passes the error (``exp`` of its log sd) as the slack.

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
    if not 1.0 <= slack < np.inf:
        raise ValueError("slack must be finite and at least 1")
    wts = np.ones(len(lens)) if weights is None else np.asarray(weights, dtype=np.float64)
    if wts.shape != lens.shape:
        raise ValueError(f"{len(wts)} weights for {len(lens)} trajectories")
    if np.any(wts <= 0) or not np.all(np.isfinite(wts)):
        raise ValueError("weights must be finite and positive")
    pre = _per_trajectory(prefill, len(lens), "prefill needs {n} finite non-negative token counts")
    tl = _per_trajectory(tool, len(lens), "tool needs {n} finite non-negative durations")
    order = np.argsort(-lens, kind="stable")
    sorted_lens = lens[order]
    wsort = sorted(range(m), key=lambda w: workers[w].per_token_s)
    starts = _aggregate(len(lens), max_items)
    heads = sorted_lens[starts[:-1]]
    # Per item: the longest tool time from its first trajectory to the end of the sorted order.
    tails = np.maximum.accumulate(tl[order][::-1])[::-1][starts[:-1]] if len(lens) else np.zeros(0)
    ordered = [workers[w] for w in wsort]
    # Per worker kind: cumulative weights in its units, and work in its weight-tokens, prefill converted
    # at its rates.
    sums: dict[tuple[float, float, float], tuple[NDArray[np.float64], NDArray[np.float64]]] = {}
    keys = []
    for prof in ordered:
        rate = prof.per_token_s * prof.work_rate
        key = (prof.min_weight, prof.weight_scale, prof.prefill_s / rate if rate > 0 else 0.0)
        keys.append(key)
        if key not in sums:
            share = prof.share(wts[order])
            sums[key] = (
                np.concatenate([[0.0], np.cumsum(share)])[starts],
                np.concatenate([[0.0], np.cumsum(share * sorted_lens + key[2] * pre[order])])[starts],
            )
    cws = [sums[k][0] for k in keys]
    cks = [sums[k][1] for k in keys]
    if method == "parametric":
        cuts = _solve_parametric(heads, tails, cws, cks, ordered, slack if spread else None)
    elif method == "dp":
        cuts = _solve_dp(heads, tails, cws, cks, ordered)
    else:
        raise ValueError(f"unknown method {method!r}")
    bounds: list[tuple[int, int]] = [(0, 0)] * m
    times = [0.0] * m
    for rank, (a, b) in enumerate(cuts):
        w = wsort[rank]
        bounds[w] = (int(starts[a]), int(starts[b]))
        if b > a:
            cw, ck = cws[rank], cks[rank]
            times[w] = _time(workers[w], heads[a], cw[b] - cw[a], ck[b] - ck[a]) + float(tails[a])
    return Partition(
        order=order,
        bounds=bounds,
        group_times=times,
        makespan=max(times) if times else 0.0,
        group_order=wsort,
    )


def realised_makespans(
    part: Partition,
    workers: Sequence[WorkerProfile],
    lengths: Sequence[float] | NDArray[np.float64],
    factors: NDArray[np.float64],
    weights: Sequence[float] | NDArray[np.float64] | None = None,
    prefill: Sequence[float] | NDArray[np.float64] | None = None,
    tool: Sequence[float] | NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """The makespan of ``part`` (placed by the predicted ``lengths``) once each trajectory's length and tool
    time turn out ``factors`` times their prediction, one row of factors per draw: what the placement
    actually gets when its predictions are off. A group's time is its realised longest member at the
    interference of its size, or its realised work at the saturated rate, plus its longest realised tool
    time. All factors 1 (with tool time nonincreasing down the sorted order) give ``part.makespan``."""
    lens = np.asarray(lengths, dtype=np.float64)
    n = len(lens)
    f = np.atleast_2d(np.asarray(factors, dtype=np.float64))
    if f.shape[1] != n:
        raise ValueError(f"{f.shape[1]} factors per draw for {n} trajectories")
    wts = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    pre = _per_trajectory(prefill, n, "prefill needs {n} finite non-negative token counts")
    tl = _per_trajectory(tool, n, "tool needs {n} finite non-negative durations")
    out = np.zeros(f.shape[0])
    for w, (a, b) in enumerate(part.bounds):
        if b <= a:
            continue
        idx = part.order[a:b]
        prof = workers[w]
        fi = f[:, idx]
        real = lens[idx] * fi
        share = prof.share(wts[idx])
        rate = prof.per_token_s * prof.work_rate
        work = real @ share + (prof.prefill_s / rate if rate > 0 else 0.0) * pre[idx].sum()
        size = np.full(len(out), share.sum())
        t = prof.group_time(real.max(axis=1), size, work) + (tl[idx] * fi).max(axis=1)
        out = np.maximum(out, t)
    return out


def _per_trajectory(
    values: Sequence[float] | NDArray[np.float64] | None, n: int, error: str
) -> NDArray[np.float64]:
    """One finite non-negative figure per trajectory (zeros if none given); ``error`` says what when not."""
    out = np.zeros(n) if values is None else np.asarray(values, dtype=np.float64)
    if out.shape != (n,) or np.any(out < 0) or not np.all(np.isfinite(out)):
        raise ValueError(error.format(n=n))
    return out


def _aggregate(n: int, max_items: int | None) -> NDArray[np.int64]:
    """Item boundaries into the sorted trajectories: one item each, or the tail in equal-count chunks."""
    if max_items is None or n <= max_items:
        return np.arange(n + 1, dtype=np.int64)
    keep = max_items // 2
    edges = np.unique(np.linspace(keep, n, max_items - keep + 1).round().astype(np.int64))
    return np.concatenate([np.arange(keep, dtype=np.int64), edges])


def _time(prof: WorkerProfile, head: float, size: float, work: float) -> float:
    return float(prof.group_time(np.array([head]), np.array([size]), np.array([work]))[0])


def _solve_dp(
    heads: NDArray[np.float64],
    tails: NDArray[np.float64],
    cws: Sequence[NDArray[np.float64]],
    cks: Sequence[NDArray[np.float64]],
    workers: Sequence[WorkerProfile],
) -> list[tuple[int, int]]:
    """Formula 3 over items (``heads`` = each item's longest length; ``cws`` and ``cks`` = per worker, the
    cumulative weight and work, the weights in its units: ``WorkerProfile.share``)."""
    n = len(heads)
    idx = np.arange(n + 1)
    head_at = np.concatenate([heads, [0.0]])  # head_at[n] is never a group's first item
    tail_at = np.concatenate([tails, [0.0]])
    prev = np.full(n + 1, np.inf)
    prev[0] = 0.0
    choices = []
    for prof, cw, ck in zip(workers, cws, cks, strict=True):

        def cost(
            k: NDArray[np.int64],
            prof: WorkerProfile = prof,
            cw: NDArray[np.float64] = cw,
            ck: NDArray[np.float64] = ck,
        ) -> NDArray[np.float64]:
            t = prof.group_time(head_at[k], cw[idx] - cw[k], ck[idx] - ck[k]) + tail_at[k]
            return np.where(idx > k, t, 0.0)

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


def _tables(workers: Sequence[WorkerProfile], total: float) -> list[NDArray[np.float64]]:
    """Each worker's F at integer sizes 0..ceil(total)+1 (F[0] floored to F[1]), validated monotone.
    Workers usually share a few profiles (one per model-parallel size): build each table once."""
    top = int(np.ceil(total)) + 1
    built: dict[int, NDArray[np.float64]] = {}
    out = []
    for prof in workers:
        f = built.get(id(prof))
        if f is None:
            f = prof.factor(np.arange(top + 1, dtype=np.float64))
            f[0] = f[1]
            if np.any(np.diff(f) < 0):
                raise ValueError("interference factor must be nondecreasing in group size")
            built[id(prof)] = f
        out.append(f)
    return out


def _capacity(table: NDArray[np.float64], y: NDArray[np.float64]) -> NDArray[np.float64]:
    """The largest group size x with F(x) <= y (F linear between the table's integer points); -1 where
    even the smallest non-empty group exceeds y."""
    top = len(table) - 1
    k = np.searchsorted(table, y, side="right") - 1
    inside = np.minimum(np.maximum(k, 0), top - 1)
    lo, hi = table[inside], table[inside + 1]
    gap = np.where(hi > lo, hi - lo, 1.0)
    frac = np.where(hi > lo, (np.minimum(y, hi) - lo) / gap, 1.0)
    x = inside + np.minimum(np.maximum(frac, 0.0), 1.0)
    return np.where(k < 0, -1.0, np.where(k >= top, float(top), x))


# Targets probed at once: each round narrows the bracket around the optimum by this factor (in log space).
PROBES = 256
# A makespan within this of the optimum is the optimum: the fill's tolerance for rounding in the cumulative
# weights admits targets a little below what the partition it finds achieves, so a tighter one only adds
# rounds that find nothing better.
EXACT = 1e-9


def _solve_parametric(
    heads: NDArray[np.float64],
    tails: NDArray[np.float64],
    cws: Sequence[NDArray[np.float64]],
    cks: Sequence[NDArray[np.float64]],
    workers: Sequence[WorkerProfile],
    spread_within: float | None = None,
) -> list[tuple[int, int]]:
    n, m = len(heads), len(workers)
    if n == 0:
        return [(0, 0)] * m
    tables = _tables(workers, max(float(cw[-1]) for cw in cws))
    speeds = [p.per_token_s for p in workers]
    rates = [p.work_rate for p in workers]
    sat_f = [
        float(p.factor(np.array([p.saturation]))[0]) if np.isfinite(p.saturation) else np.inf for p in workers
    ]
    # Zero-length trajectories fit anywhere; a tiny head keeps every division finite. Past the end, a
    # worker with nothing left takes "everything" (nothing).
    head = np.concatenate([np.maximum(heads, 1e-300), [1e-300]])
    tail = np.concatenate([tails, [0.0]])
    tools = bool(tails.any())
    slack = 1e-11 * max(1.0, *(float(cw[-1]) for cw in cws))  # cumulative weights carry rounding

    def fill(targets: NDArray[np.float64], caps: NDArray[np.float64] | None = None) -> NDArray[np.int64]:
        """Greedy fill for every target at once: the group starts, (m+1, K); all fit where the last is n.
        ``caps``: per target, the most a worker takes, in multiples of its saturation."""
        starts = np.zeros((m + 1, len(targets)), dtype=np.int64)
        start = starts[0]
        for j in range(m):
            cw, ck = cws[j], cks[j]
            left = targets - tail[start] if tools else targets  # what the group's tools leave it
            y = left / (head[start] * speeds[j])
            room = _capacity(tables[j], y)
            if np.isfinite(sat_f[j]):
                # The head term binds only below saturation; past it, the work term does.
                room = np.where(y >= sat_f[j], np.inf, room)
                if caps is not None:
                    room = np.minimum(room, caps * workers[j].saturation)
            end = np.searchsorted(cw, cw[start] + room + slack, side="right") - 1
            if rates[j] > 0:
                budget = left / (speeds[j] * rates[j])
                by_work = np.searchsorted(ck, ck[start] + budget * (1 + 1e-12), side="right") - 1
                end = np.minimum(end, by_work)
            starts[j + 1] = np.where(room < 0, start, np.minimum(np.maximum(end, start), n))
            start = starts[j + 1]
        return starts

    # Workers of one profile share its tables: a partition's groups are priced a kind at a time.
    kinds: dict[int, list[int]] = {}
    for j, p in enumerate(workers):
        kinds.setdefault(id(p), []).append(j)
    by_kind = [(workers[js[0]], np.array(js), cws[js[0]], cks[js[0]]) for js in kinds.values()]

    def span(cuts: NDArray[np.int64]) -> float:
        worst = 0.0
        for prof, js, cw, ck in by_kind:
            a, b = cuts[js], cuts[js + 1]
            a, b = a[b > a], b[b > a]
            if len(a):
                t = prof.group_time(heads[a], cw[b] - cw[a], ck[b] - ck[a]) + tails[a]
                worst = max(worst, float(t.max()))
        return worst

    # The longest alone on the fastest, with its tools.
    lo = float(heads[0] * min(speeds) * min(t[1] for t in tables) + tails[0])
    if len({id(ck) for ck in cks}) == 1 and all(r > 0 for r in rates):
        # Every worker counts work in the same units: together they clear at most the sum of their rates
        # (tools only add to a group's time, so the bound without them holds).
        lo = max(lo, float(cks[0][-1]) / sum(1.0 / (s * r) for s, r in zip(speeds, rates, strict=True)))
    # Everything on the fastest worker: the partition a target of infinity fills, priced without a fill.
    best = np.array([0] + [n] * m, dtype=np.int64)
    hi = _time(workers[0], heads[0], float(cws[0][-1]), float(cks[0][-1])) + float(tails[0])
    probe_lo = True  # lo is a lower bound but may itself be feasible: the first round tries it
    while hi > lo * (1 + EXACT):
        # Ascending targets, the last just below the best makespan found. Feasibility is monotone in the
        # target, so if even that one fails, the best found is optimal.
        grid = np.geomspace(lo, hi, PROBES + 1)[:-1]
        targets = np.append(grid if probe_lo else grid[1:], hi * (1 - EXACT))
        ok = fill(targets)
        fits = ok[m] == n
        if not fits[-1]:
            break
        i = int(np.argmax(fits))  # the smallest target that fits: its makespan is at most that target
        got = span(ok[:, i])
        progress = got < hi or i > 0
        if got < hi:
            best, hi = ok[:, i], got
        if i > 0:
            lo = float(targets[i - 1])
        probe_lo = False
        if not progress:
            break  # the bracket is as tight as rounding in the weights allows
    if spread_within is not None and any(np.isfinite(p.saturation) for p in workers):
        best = _spread(fill, best, hi * spread_within, max(float(cw[-1]) for cw in cws), workers)
    return _cuts(best)


def _spread(
    fill: Callable[[NDArray[np.float64], NDArray[np.float64]], NDArray[np.int64]],
    best: NDArray[np.int64],
    makespan: float,
    total: float,
    workers: Sequence[WorkerProfile],
) -> NDArray[np.int64]:
    """Among the partitions that meet ``makespan`` (the optimum, or the most the predictions cannot tell
    from it), one that loads no worker further past its saturation than it must: the smallest cap (a
    multiple of saturation) at which the fill still meets it.
    The optimum is set by a few groups and leaves the others slack, which the greedy fill spends packing
    the first workers full while the last stand idle. Packed past saturation, a worker queues what it
    cannot batch, and where the predictions are exact the priority order keeps the group's longest ahead;
    where they are not, the one that turns out longest may wait its turn behind a queue of hundreds (the
    search workload at 64 GPUs: 1,545 of 1,600 trajectories on one worker, the last to finish queued 6.7 s
    of its 19.8). The slack is better spent spreading them."""
    n = int(best[-1])
    sat = min(p.saturation for p in workers if np.isfinite(p.saturation))
    lo, hi = 0.0, max(1.0, total / sat) * (1 + 1e-9)
    target = np.array([makespan * (1 + EXACT)])
    for _ in range(3):  # each round narrows the bracket PROBES-fold
        caps = np.linspace(lo, hi, PROBES + 1)[1:]
        ok = fill(np.repeat(target, len(caps)), caps)
        fits = ok[len(workers)] == n
        if not fits.any():
            return best
        i = int(np.argmax(fits))
        best = ok[:, i]
        lo, hi = (float(caps[i - 1]) if i else lo), float(caps[i])
    return best


def _cuts(starts: NDArray[np.int64]) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in itertools.pairwise(starts)]

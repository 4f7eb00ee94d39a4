"""Deterministic event-driven core of the simulated engine: continuous batching in simulated time.

Each iteration prefills up to ``prefill_budget`` uncached tokens (chunked) and decodes one token for
every sequence past its prefill; its duration comes from the performance model. Runs of pure-decode
iterations with the same batch are taken in one jump up to the next event (a finish, the KV cache filling,
an arrival, or the time asked for), so simulating costs O(events), not O(tokens).

Every request produces exactly ``max_new_tokens`` (as with ``ignore_eos``): replayed workloads emit their
recorded token counts, so the simulator never stops early.

Trajectories start alike (``EngineRequest.shared_prefix``): every one of a task set from its system prompt,
the samples of a GRPO group from their prompt. A request admitted after another trajectory has prefilled
such a prefix on this engine (cached, or running now) prefills only the rest of its input, as a radix cache
would find it. Requests admitted in the same iteration each compute it (SGLang's in-batch prefix check is
only in its cache-aware queue orders, not under priority scheduling).

A trajectory's cached prefix can move between engines (migration): ``export_prefix`` on the source,
``import_prefix`` on the target, where it lands after the KV transfer time and is evictable from then on.

With a host tier (SGLang's HiCache, ``--enable-hierarchical-cache --hicache-ratio R``), what the device
cache evicts is kept in host memory, R times the device pool, and a request admitted later loads it back
over the GPUs' host links instead of recomputing it. The load overlaps the iteration layer by layer, so
that iteration lasts the longer of its compute and the transfer.

New weights (``commit_weights``) make every cached KV stale: the caches are emptied and the running
sequences recompute their context before decoding on, each at the prefill cost of the performance model.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Literal

from loom.engine.base import EngineLoad, EngineOutput, EngineRequest
from loom.engine.model.perf import PerfModel
from loom.engine.sim.prefix_cache import PrefixCache

_WAITING, _PREFILL, _DECODE, _DONE = range(4)


@dataclass(slots=True, eq=False)
class _Seq:
    req: EngineRequest
    seq: int  # submission order: FIFO among equal priorities
    mark: float  # when the current phase (queue, prefill, decode) began
    state: int = _WAITING
    generated: int = 0
    step0: int = 0  # decode step at which ``generated`` was last brought up to date
    finish_step: int = 0
    cached: int = 0  # tokens of context reused from the prefix cache in the current admission
    shares_to: int = 0  # the longest of its shared prefixes: past it, nothing is anyone else's
    prefill_left: int = 0
    first_cached: int = -1
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def context(self) -> int:
        return self.req.input_len + self.generated


@dataclass(slots=True)
class _Chunk:
    """A planned run of iterations with one batch: one iteration when it prefills, else many decodes."""

    start: float
    end: float
    iters: int
    decoders: int
    decode_kv: int
    growth: int  # KV tokens added per iteration
    prefill: list[tuple[_Seq, int]] = field(default_factory=list)


# SGLang's --hicache-ratio default: the host pool is twice the device pool.
HICACHE_RATIO = 2.0


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding in an engine: each decode step verifies ``positions`` positions per sequence on
    average (its last token and its draft) and keeps ``tokens_per_step`` tokens per sequence, both as
    measured on the traces (``loom bench speculative``). The core still advances one token per sequence per
    iteration, each costing a verification step's time over ``tokens_per_step``: the expected time, not a
    draw per step, which over the hundreds of steps of a decode differs by little."""

    positions: float
    tokens_per_step: float

    def __post_init__(self) -> None:
        if not 1.0 <= self.tokens_per_step <= self.positions:
            raise ValueError(
                f"need 1 <= tokens_per_step <= positions, got {self.tokens_per_step}, {self.positions}"
            )


def build_core(
    model: str = "qwen3-8b",
    gpu: str = "h100",
    tp: int = 1,
    *,
    mem_fraction: float = 0.9,
    max_running: int = 256,
    start: float = 0.0,
    preempt_threshold: float | None = 10.0,
    evict_by_priority: bool = False,
    hicache_ratio: float = 0.0,
    speculation: Speculation | None = None,
) -> SimCore:
    """A core for ``model`` on ``tp`` x ``gpu``, with the KV capacity the memory leaves beside the weights
    and, with ``hicache_ratio`` > 0, a host tier that many times the device pool."""
    perf = PerfModel(gpu, model, tp)
    capacity = perf.kv_capacity_tokens(mem_fraction)
    if capacity <= 0:
        raise ValueError(f"{model} does not fit on {tp} x {gpu} at mem_fraction {mem_fraction}")
    return SimCore(
        perf,
        capacity,
        max_running=max_running,
        start=start,
        preempt_threshold=preempt_threshold,
        evict_by_priority=evict_by_priority,
        host_kv_tokens=int(hicache_ratio * capacity),
        speculation=speculation,
    )


class SimCore:
    def __init__(
        self,
        perf: PerfModel,
        kv_capacity: int,
        max_running: int = 256,
        prefill_budget: int = 8192,
        reserve_ratio: float = 0.1,
        start: float = 0.0,
        preempt_threshold: float | None = 10.0,
        evict_by_priority: bool = False,
        host_kv_tokens: int = 0,
        speculation: Speculation | None = None,
    ) -> None:
        self.speculation = speculation
        if host_kv_tokens < 0:
            raise ValueError(f"host_kv_tokens must be >= 0, got {host_kv_tokens}")
        if kv_capacity <= 0 or max_running < 1 or prefill_budget < 1:
            raise ValueError("kv_capacity, max_running and prefill_budget must be positive")
        if not 0.0 <= reserve_ratio <= 1.0:
            raise ValueError(f"reserve_ratio must be in [0, 1], got {reserve_ratio}")
        self.perf = perf
        self.kv_capacity = kv_capacity
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        # Admission keeps this fraction of the running sequences' remaining output free, like SGLang's
        # new_token_ratio, so that a full cache does not retract the request it has just admitted.
        self.reserve_ratio = reserve_ratio
        # A waiting request whose priority exceeds the lowest running one's by more than this evicts it
        # (SGLang --enable-priority-scheduling, --priority-scheduling-preemption-threshold 10; Heddle's
        # Algorithm 1). None: never preempt for priority.
        self.preempt_threshold = preempt_threshold
        self.preemptions = 0
        self.weight_version = ""
        self.host_kv_tokens = host_kv_tokens
        self.host = PrefixCache(by_priority=evict_by_priority) if host_kv_tokens else None
        self.cache = PrefixCache(
            by_priority=evict_by_priority, on_evict=self._spill if self.host is not None else None
        )
        self.loaded_tokens = 0  # brought back from the host tier instead of recomputed
        self._loading = 0  # tokens loaded for the next iteration, which lasts at least their transfer
        self.generated_tokens = 0
        self.retractions = 0
        self._now = start
        self._step = 0  # iterations run so far; a decoding sequence gains one token per step
        self._seq = 0
        self._reqs: dict[str, _Seq] = {}
        self._arrivals: list[tuple[float, int, str]] = []  # not yet visible to the scheduler
        self._queue: list[tuple[float, int, str]] = []  # (-priority, seq, rid)
        self._waiting = 0
        self._running: dict[str, _Seq] = {}
        # (priority, -seq, rid) of every admission, popped lazily once its sequence has left the batch.
        self._ranked: list[tuple[float, int, str]] = []
        self._prefilling: dict[str, _Seq] = {}  # admission order: the chunked prefill goes first
        self._decoding: dict[str, _Seq] = {}
        self._finishes: list[tuple[int, int, str]] = []  # (finish_step, seq, rid) of decoding sequences
        self._decode_kv = 0  # context of all decoding sequences together
        self._private = 0  # KV held by running sequences beyond what they reuse from the prefix cache
        self._remaining = 0  # tokens the running sequences have still to generate
        self._chunk: _Chunk | None = None
        self._outbox: list[EngineOutput] = []
        self._imports: list[tuple[float, int, str, int]] = []  # (lands at, seq, prefix_key, tokens)
        # A shared_prefix level -> the prefix keys here that start with it, and back.
        self._sharers: dict[str, set[str]] = {}
        self._levels: dict[str, tuple[str, ...]] = {}
        self._ended: set[str] = set()  # prefix keys of ended trajectories among them, until their cache goes
        self._live: dict[str, _Seq] = {}  # prefix key -> its request in the batch (of those that share)

    @property
    def now(self) -> float:
        return self._now

    @property
    def kv_used_tokens(self) -> int:
        return self.cache.tokens + self._private

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            waiting=self._waiting,
            kv_used_tokens=self.kv_used_tokens,
            kv_capacity_tokens=self.kv_capacity,
            generated_tokens=self.generated_tokens,
            extra={
                "cached_tokens": float(self.cache.tokens),
                "evictable_tokens": float(self.cache.evictable),
                "retractions": float(self.retractions),
                "host_cached_tokens": float(self.host.tokens if self.host is not None else 0),
                "host_loaded_tokens": float(self.loaded_tokens),
            },
        )

    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue ``req``, arriving at ``now``; it joins the first iteration that starts at or after then."""
        if req.rid in self._reqs:
            raise ValueError(f"request {req.rid!r} is already in flight")
        if req.input_len < 0 or req.max_new_tokens < 0:
            raise ValueError(f"request {req.rid!r} has negative lengths")
        if req.input_len + req.max_new_tokens > self.kv_capacity:
            raise ValueError(
                f"request {req.rid!r} needs {req.input_len + req.max_new_tokens} KV tokens, "
                f"the engine holds {self.kv_capacity}"
            )
        # A request without a key of its own neither offers its context nor looks for another's.
        shares = req.shared_prefix if req.prefix_key is not None else ()
        if shares:
            assert req.prefix_key is not None
            levels = tuple(dict.fromkeys(level for level, _ in shares))
            for level in levels:
                self._sharers.setdefault(level, set()).add(req.prefix_key)
            self._levels[req.prefix_key] = levels
            self._ended.discard(req.prefix_key)
        arrival = max(now, self._now)
        self._seq += 1
        s = _Seq(req, self._seq, mark=arrival, shares_to=max((t for _, t in shares), default=0))
        self._reqs[req.rid] = s
        heapq.heappush(self._arrivals, (arrival, s.seq, req.rid))
        self._waiting += 1
        self._chunk = None

    def reprioritize(self, rid: str, priority: float) -> bool:
        """A waiting request's new priority (the router re-keys its admission queue when a prediction
        changes; a running request keeps its place). Whether the request was waiting."""
        s = self._reqs.get(rid)
        if s is None or s.state != _WAITING or s.req.priority == priority:
            return s is not None and s.state == _WAITING
        s.req = dataclasses.replace(s.req, priority=priority)
        if s.mark <= self._now:  # arrived: it waits in the queue (one still arriving enters it re-keyed)
            heapq.heappush(self._queue, (-priority, s.seq, rid))
        self._chunk = None
        return True

    def abort(self, rid: str, now: float) -> EngineOutput | None:
        """Abort a waiting or running request, freeing its KV; its output, or None if it is not in flight."""
        s = self._reqs.get(rid)
        if s is None:
            return None
        now = max(now, self._now)
        if s.state == _WAITING:
            self._waiting -= 1
            s.queue_s += max(0.0, now - s.mark)
        else:
            self._leave_running(s, now, keep_cache=False)
        self._chunk = None
        return self._close(s, "abort")

    def export_prefix(self, prefix_key: str, remove: bool = True) -> int:
        """Tokens cached for ``prefix_key``; with ``remove``, drop what no running request reuses."""
        length = self.cache.length(prefix_key)
        if remove:
            self.cache.trim(prefix_key)
            if self.host is not None:
                self.host.trim(prefix_key)
        return length

    def end_prefix(self, prefix_key: str) -> None:
        """The trajectory behind ``prefix_key`` has ended: its cache is the first to go."""
        self.cache.demote(prefix_key)
        if self.host is not None:
            self.host.demote(prefix_key)
        if prefix_key in self._levels:
            self._ended.add(prefix_key)

    def import_prefix(
        self, prefix_key: str, tokens: int, now: float, bandwidth_gbps: float | None = None
    ) -> float:
        """Start receiving ``tokens`` of ``prefix_key``'s KV at ``now``; return when they land. Requests
        admitted from then on reuse them. The landing takes free or evictable KV only, so it never retracts a
        running request; what does not fit is dropped."""
        if tokens < 0:
            raise ValueError(f"cannot import {tokens} tokens")
        lands = max(now, self._now) + self.perf.kv_transfer_time(tokens, bandwidth_gbps)
        self._seq += 1
        heapq.heappush(self._imports, (lands, self._seq, prefix_key, tokens))
        return lands

    def commit_weights(self, version: str, now: float, flush_cache: bool = True) -> None:
        """Serve new weights as ``version`` from ``now``; requests finished before keep the old version.

        Every KV computed so far came from the old weights, so with ``flush_cache`` it all goes: the prefix
        cache and its host tier are emptied (a trajectory's next call prefills its whole context again),
        transfers still landing are dropped, and each running sequence goes back to the queue without its
        KV, so that it recomputes its context (prompt and tokens generated so far) as a prefill before it
        decodes further. Nothing loses its place: the queue orders by priority, then submission. Without ``flush_cache`` only the version changes and the old KV stays in use (SGLang
        updated with ``flush_cache`` false)."""
        self.weight_version = version
        if not flush_cache:
            return
        self.stall(now)
        for s in list(self._running.values()):
            self._leave_running(s, self._now, keep_cache=False)
            s.prefill_left = 0
            s.state = _WAITING
            self._waiting += 1
            heapq.heappush(self._queue, (-s.req.priority, s.seq, s.req.rid))
        spill, self.cache.on_evict = self.cache.on_evict, None  # stale KV is not kept on the host either
        self.cache.evict(self.cache.tokens)
        self.cache.on_evict = spill
        if self.host is not None:
            self.host.evict(self.host.tokens)
        self._imports.clear()
        self._loading = 0

    def stall(self, until: float) -> None:
        """Let simulated time pass with no iterations (a paused engine); queued work keeps waiting."""
        self._chunk = None
        self._now = max(self._now, until)

    def next_event_time(self) -> float | None:
        """When ``advance`` next has something to do, or None if the engine is idle with nothing queued.

        Planning the next run of iterations commits its scheduling decisions (admissions, retractions)
        at its start time, which is ``now``."""
        if not self._outbox and self._chunk is None:
            self._chunk = self._plan()
        if self._outbox:
            return self._now
        if self._chunk is not None:
            return self._chunk.end
        return self._next_arrival()

    def advance(self, until: float) -> list[EngineOutput]:
        """Run every iteration that ends by ``until``; return the requests finished (or aborted at
        admission) since the last call."""
        while True:
            if self._chunk is None:
                self._chunk = self._plan()
            chunk = self._chunk
            if chunk is None:
                arrival = self._next_arrival()
                if arrival is not None and arrival <= until:
                    self._now = max(self._now, arrival)
                    continue
                self._now = max(self._now, until)
                break
            if chunk.end <= until:
                self._commit(chunk, chunk.iters)
                continue
            if not chunk.prefill and chunk.iters > 1:
                iters = self._iters_within(chunk, until - chunk.start)
                if iters:
                    self._commit(chunk, iters)
            break
        self._land()
        out, self._outbox = self._outbox, []
        return out

    # Scheduling

    def _plan(self) -> _Chunk | None:
        self._land()
        while self._arrivals and self._arrivals[0][0] <= self._now:
            _, seq, rid = heapq.heappop(self._arrivals)
            s = self._reqs.get(rid)
            if s is not None and s.seq == seq:
                heapq.heappush(self._queue, (-s.req.priority, seq, rid))
        prefill, budget, growth = self._prefill_plan()
        while self._running and self._growth_room(growth) < growth:
            self._retract(self._lowest_running())
            prefill, budget, growth = self._prefill_plan()
        prefill, budget, growth = self._admit_queue(prefill, budget, growth)
        for _ in range(len(self._running)):
            victim = self._preemption_victim(budget)
            if victim is None:
                break
            self._retract(victim)
            self.preemptions += 1
            prefill, budget, growth = self._admit_queue(*self._prefill_plan())
        if not self._running:
            return None
        decoders = len(self._decoding)
        if prefill:
            attended = sum(take * (s.context - s.prefill_left) + take * (take + 1) / 2 for s, take in prefill)
            tokens = sum(take for _, take in prefill)
            dt = max(self.perf.iteration_time(tokens, decoders, self._decode_kv, attended), self._load_s())
            return _Chunk(self._now, self._now + dt, 1, decoders, self._decode_kv, growth, prefill)
        if self._loading:
            dt = max(self._span(decoders, self._decode_kv, 1), self._load_s())
            return _Chunk(self._now, self._now + dt, 1, decoders, self._decode_kv, decoders)
        # Pure decode: the batch stays the same until a sequence finishes or the KV cache fills, since a
        # blocked queue head stays blocked while the running sequences only grow.
        until_finish = self._next_finish_step() - self._step
        iters = min(until_finish, self._growth_room(until_finish * decoders) // decoders)
        chunk = _Chunk(self._now, 0.0, iters, decoders, self._decode_kv, decoders)
        arrival = self._next_arrival()
        if arrival is not None:
            chunk.iters = min(iters, self._iters_within(chunk, arrival - self._now) + 1)
        chunk.end = self._now + self._span(decoders, self._decode_kv, chunk.iters)
        return chunk

    def _admit_queue(
        self, prefill: list[tuple[_Seq, int]], budget: int, growth: int
    ) -> tuple[list[tuple[_Seq, int]], int, int]:
        """Admit from the head of the queue, in strict priority order, while slots, budget and KV allow."""
        while len(self._running) < self.max_running:
            s = self._queue_head()
            if s is None:
                break
            key = s.req.prefix_key
            cached = min(self.cache.length(key), s.context) if key is not None else 0
            uncached = s.context - cached
            hosted = self.host.length(key) if self.host is not None and key is not None else 0
            loads = max(0, min(hosted, s.context) - cached)
            shared = self._shared_here(s, cached + loads) if cached + loads < s.shares_to else 0
            compute = uncached - loads - shared
            take = min(compute, budget)
            if compute and not take:
                break
            grows = int(take == compute and s.generated < s.req.max_new_tokens)
            later = self._remaining + s.req.max_new_tokens - s.generated - grows
            need = uncached + grows + self.reserve_ratio * later + growth
            if self.cache.by_priority and self._running:
                # Only the caches of lower-priority trajectories may make room (see PrefixCache).
                free = self.kv_capacity - self.kv_used_tokens
                room = free + self.cache.evictable_below(int(need) + 1 - free, s.req.priority, key)
            else:
                pinned = self.cache.pin_gain(key, cached) if key is not None else 0
                room = self._avail() - pinned
            if need > room:
                break  # strict priority order: nothing jumps the head of the queue
            heapq.heappop(self._queue)
            if loads:
                assert key is not None
                self._load(key, cached + loads)
                cached += loads
            self._admit(s, cached, shared)
            if take:
                prefill.append((s, take))
                budget -= take
            growth += grows
        return prefill, budget, growth

    def _lowest_running(self) -> _Seq:
        """Who is evicted first, for memory or for priority: the lowest priority, the newest on ties (SGLang)."""
        while True:
            _, neg_seq, rid = self._ranked[0]
            s = self._running.get(rid)
            if s is not None and s.seq == -neg_seq:
                return s
            heapq.heappop(self._ranked)

    def _preemption_victim(self, budget: int) -> _Seq | None:
        """The running request the blocked queue head evicts: the lowest priority, newest on ties."""
        head = self._queue_head()
        if head is None or not self._running or self.preempt_threshold is None or budget <= 0:
            return None
        victim = self._lowest_running()
        return victim if head.req.priority > victim.req.priority + self.preempt_threshold else None

    def _prefill_plan(self) -> tuple[list[tuple[_Seq, int]], int, int]:
        """Budget shares of the running prefills, the budget left, and the KV growth of one iteration."""
        prefill = []
        budget = self.prefill_budget
        growth = len(self._decoding)
        for s in self._prefilling.values():
            take = min(s.prefill_left, budget)
            if not take:
                break
            prefill.append((s, take))
            budget -= take
            growth += int(take == s.prefill_left and s.generated < s.req.max_new_tokens)
        return prefill, budget, growth

    def _span(self, decoders: int, decode_kv: int, iters: int) -> float:
        """Seconds for ``iters`` decode iterations (a token per sequence each), verification steps when the
        engine drafts."""
        spec = self.speculation
        if spec is None:
            return self.perf.decode_span(decoders, decode_kv, iters)
        return self.perf.decode_span(decoders, decode_kv, iters, spec.positions) / spec.tokens_per_step

    def _iters_within(self, chunk: _Chunk, seconds: float) -> int:
        """The most iterations of ``chunk`` that fit in ``seconds``."""
        span = self._span
        d, kv = chunk.decoders, chunk.decode_kv
        # Iterations only slow down as the contexts grow, so the first and the last one's time bracket
        # the answer; the bisection then runs over a few candidates, not over the whole chunk.
        first = span(d, kv, 1)
        hi = min(chunk.iters, int(seconds // first)) if first > 0 else chunk.iters
        if hi <= 0:
            return 0
        last = span(d, kv + d * (hi - 1), 1)
        lo = min(hi, int(seconds // last)) if last > 0 else hi
        if lo and span(d, kv, lo) > seconds:  # rounding at the boundary
            lo = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if span(d, kv, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _commit(self, chunk: _Chunk, iters: int) -> None:
        end = (
            chunk.end
            if iters == chunk.iters
            else chunk.start + self._span(chunk.decoders, chunk.decode_kv, iters)
        )
        self._loading = 0
        self._reserve(chunk.growth * iters)
        self._private += chunk.growth * iters
        self._step += iters
        self._decode_kv += chunk.decoders * iters
        self._remaining -= chunk.decoders * iters
        self.generated_tokens += chunk.decoders * iters
        self._now = end
        self._chunk = None
        while self._finishes and self._finishes[0][0] <= self._step:
            _, seq, rid = heapq.heappop(self._finishes)
            s = self._reqs.get(rid)
            if s is not None and s.seq == seq and s.state == _DECODE and s.finish_step <= self._step:
                self._finish(s)
        for s, take in chunk.prefill:
            s.prefill_left -= take
            if s.prefill_left:
                continue
            s.prefill_s += end - s.mark
            s.mark = end
            if s.generated < s.req.max_new_tokens:
                s.generated += 1  # the last prefill chunk samples the first token
                self._remaining -= 1
                self.generated_tokens += 1
            if s.generated == s.req.max_new_tokens:
                self._finish(s)
            else:
                del self._prefilling[s.req.rid]
                self._start_decode(s)

    # Sequence transitions

    def _shared_here(self, s: _Seq, have: int) -> int:
        """Tokens of ``s``'s input past the ``have`` it holds that another trajectory starting alike holds on this
        engine: in its cache, or computed by its request in the batch now.

        Their KV is still counted as the request's own (as if copied, where a radix tree would point at it):
        what sharing saves here is the prefill, and the cache's size stays an upper bound (which the makespan's
        lower bound, ``loom.bench.harness.bounds``, relies on). A trajectory's keys stay listed on an engine it
        has left (routed or migrated elsewhere) for the rest of the run: ``end_prefix`` reaches only the last."""
        out = have
        for level, tokens in s.req.shared_prefix:
            if tokens <= out:
                continue
            gone = []
            for k in self._sharers.get(level, ()):
                if k == s.req.prefix_key:
                    continue
                live = self._live.get(k)  # a radix cache takes a prefill in as it ends
                held = max(self.cache.length(k), live.context - live.prefill_left if live else 0)
                if not held and k in self._ended:
                    gone.append(k)
                out = max(out, min(tokens, held))
                if out >= tokens:
                    break
            for k in gone:  # an ended trajectory whose cache has gone: forget it
                for other in self._levels.pop(k):
                    keys = self._sharers.get(other, set())
                    keys.discard(k)
                    if not keys:
                        self._sharers.pop(other, None)
                self._ended.discard(k)
        return min(out, s.context) - have

    def _admit(self, s: _Seq, cached: int, shared: int = 0) -> None:
        s.queue_s += self._now - s.mark
        s.mark = self._now
        self._waiting -= 1
        if s.first_cached < 0:
            s.first_cached = cached + shared
        s.cached = cached
        if s.req.prefix_key is not None:
            self.cache.acquire(s.req.prefix_key, s.req.rid, cached, s.req.priority)
            if s.req.shared_prefix:
                self._live[s.req.prefix_key] = s
        uncached = s.context - cached
        self._reserve(uncached)
        self._private += uncached
        self._remaining += s.req.max_new_tokens - s.generated
        self._running[s.req.rid] = s
        heapq.heappush(self._ranked, (s.req.priority, -s.seq, s.req.rid))
        if len(self._ranked) > 4 * len(self._running) + 64:
            self._ranked = [(x.req.priority, -x.seq, r) for r, x in self._running.items()]
            heapq.heapify(self._ranked)
        if uncached > shared:
            s.state = _PREFILL
            s.prefill_left = uncached - shared
            self._prefilling[s.req.rid] = s
        elif s.generated == s.req.max_new_tokens:
            self._finish(s)
        else:
            self._start_decode(s)

    def _start_decode(self, s: _Seq) -> None:
        s.state = _DECODE
        s.step0 = self._step
        s.finish_step = self._step + s.req.max_new_tokens - s.generated
        self._decoding[s.req.rid] = s
        self._decode_kv += s.context
        heapq.heappush(self._finishes, (s.finish_step, s.seq, s.req.rid))

    def _leave_running(self, s: _Seq, now: float, keep_cache: bool) -> None:
        """Take ``s`` out of the batch and free its KV; with ``keep_cache`` the context it has computed
        becomes its key's cached prefix (a finish or a retraction), otherwise the key keeps its length."""
        rid = s.req.rid
        if s.state == _DECODE:
            s.generated += self._step - s.step0
            self._decode_kv -= s.context
            del self._decoding[rid]
            s.decode_s += now - s.mark
        elif s.state == _PREFILL:
            del self._prefilling[rid]
            s.prefill_s += now - s.mark
        del self._running[rid]
        self._private -= s.context - s.cached
        self._remaining -= s.req.max_new_tokens - s.generated
        if s.req.prefix_key is not None:
            self.cache.release(s.req.prefix_key, rid, s.context - s.prefill_left if keep_cache else None)
            if self._live.get(s.req.prefix_key) is s:
                del self._live[s.req.prefix_key]
        s.mark = now

    def _retract(self, s: _Seq) -> None:
        """Preempt ``s`` back to the queue; its computed context stays cached (evictable), as in SGLang."""
        self._leave_running(s, self._now, keep_cache=True)
        s.prefill_left = 0
        s.state = _WAITING
        self._waiting += 1
        heapq.heappush(self._queue, (-s.req.priority, s.seq, s.req.rid))
        self.retractions += 1

    def _finish(self, s: _Seq) -> None:
        self._leave_running(s, self._now, keep_cache=True)
        self._outbox.append(self._close(s, "length"))

    def _close(self, s: _Seq, reason: Literal["length", "abort"]) -> EngineOutput:
        s.state = _DONE
        del self._reqs[s.req.rid]
        return EngineOutput(
            rid=s.req.rid,
            output_len=s.generated,
            finish_reason=reason,
            queue_s=s.queue_s,
            prefill_s=s.prefill_s,
            decode_s=s.decode_s,
            cached_tokens=max(0, s.first_cached),
            weight_version=self.weight_version,
        )

    # KV accounting

    def _avail(self) -> int:
        """KV tokens obtainable now: free ones plus evictable cached ones."""
        return self.kv_capacity - self.kv_used_tokens + self.cache.evictable

    def _growth_room(self, tokens: int) -> int:
        """KV the running batch may grow into, counted up to ``tokens``: free KV and evictable caches, but
        with priority eviction only the caches of trajectories ranked at most the lowest running one. A
        long trajectory's context waiting out a tool call outranks a short one's growth, so the short one
        is retracted instead (Heddle's Algorithm 1 line 8: the preempted keep their KV, the rest recompute).
        A batch of one may take every cache, as its admission did: retracting it would only readmit it."""
        if not (self.cache.by_priority and len(self._running) > 1):
            return self._avail()
        free = self.kv_capacity - self.kv_used_tokens
        below = self.cache.evictable_below(max(0, tokens - free), self._lowest_running().req.priority)
        return free + below

    def _reserve(self, tokens: int) -> None:
        short = tokens - (self.kv_capacity - self.kv_used_tokens)
        if short > 0 and self.cache.evict(short) < short:
            raise AssertionError("KV reservation beyond what the plan checked")

    def _spill(self, key: str, length: int, priority: float) -> None:
        """The device cache is evicting part of ``key``: the host tier keeps up to ``length`` of it (write
        through: a host entry counts its whole prefix), evicting in its own order for room, ``key``'s tail
        included when it ranks lowest."""
        assert self.host is not None
        self.host.insert(key, length, priority)
        over = self.host.tokens - self.host_kv_tokens
        if over > 0:
            self.host.evict(over)  # nothing is pinned on the host: this always frees enough

    def _load(self, key: str, length: int) -> None:
        """Bring ``key``'s cached prefix up to ``length`` tokens from the host tier, making room in the
        device cache (the admission check counted these tokens as needed KV)."""
        gain = length - self.cache.length(key)
        short = gain - (self.kv_capacity - self.kv_used_tokens)
        if short > 0 and self.cache.evict(short, spare=key) < short:
            raise AssertionError("host load beyond what the admission checked")
        self.cache.insert(key, length)
        self.loaded_tokens += gain
        self._loading += gain

    def _load_s(self) -> float:
        return (
            self.perf.kv_transfer_time(self._loading, self.perf.gpu.host_link_gbps) if self._loading else 0.0
        )

    def _land(self) -> None:
        """Cache the imports whose transfer has finished, in free KV or in place of other evictable prefixes.

        This keeps ``_avail`` unchanged, so a run of iterations planned before a landing stays valid."""
        while self._imports and self._imports[0][0] <= self._now:
            _, _, key, tokens = heapq.heappop(self._imports)
            gain = tokens - self.cache.length(key)
            if gain <= 0:
                continue
            short = gain - (self.kv_capacity - self.kv_used_tokens)
            if short > 0:
                gain -= short - self.cache.evict(short, spare=key)
            self.cache.insert(key, self.cache.length(key) + gain)

    def _queue_head(self) -> _Seq | None:
        while self._queue:
            neg, seq, rid = self._queue[0]
            s = self._reqs.get(rid)
            # An entry under an old priority is stale once the request was re-keyed.
            if s is not None and s.seq == seq and s.state == _WAITING and -neg == s.req.priority:
                return s
            heapq.heappop(self._queue)
        return None

    def _next_arrival(self) -> float | None:
        while self._arrivals:
            arrival, seq, rid = self._arrivals[0]
            s = self._reqs.get(rid)
            if s is not None and s.seq == seq and s.state == _WAITING:
                return arrival
            heapq.heappop(self._arrivals)
        return None

    def _next_finish_step(self) -> int:
        while True:
            step, seq, rid = self._finishes[0]
            s = self._reqs.get(rid)
            if s is not None and s.seq == seq and s.state == _DECODE and s.finish_step == step:
                return step
            heapq.heappop(self._finishes)

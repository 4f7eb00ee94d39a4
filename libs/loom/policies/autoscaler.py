"""Reward worker autoscaling: Knative's pod autoscaler (KPA) applied to a pool shared by tenants.

Demand is a tenant's concurrency: its requests not yet done (queued or running). The pool aims at
``target`` concurrent requests per worker, averaged over a stable window; a short panic window catches a
burst (when it asks for ``panic_threshold`` times the current pool, the pool grows at once and does not
shrink until the burst has been gone a whole stable window). A tenant with no demand for
``scale_to_zero_grace_s`` drops to its minimum, zero by default, so an idle pool costs nothing.
Tenants get workers within their own ``min_workers``/``max_workers``; when the pool's ``max_workers``
cannot cover everyone, it is split by weighted max-min fairness.

Where Loom departs from Knative: a reward worker starts in tens of milliseconds (forked from a warm
server), so a worker beyond what the demand needs right now is retired once it has been idle as long as a
cold start takes. Keeping it longer cannot pay off and retiring it sooner risks paying the start twice:
the ski-rental break-even, within twice the cost of knowing the future. The windows still decide growth.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScalePolicy:
    target: float = 1.0
    stable_window_s: float = 6.0
    panic_window_s: float = 0.6
    panic_threshold: float = 2.0
    scale_to_zero_grace_s: float = 2.0
    max_workers: int = 8

    def __post_init__(self) -> None:
        if self.target <= 0 or self.max_workers < 1:
            raise ValueError("target must be positive and max_workers at least 1")
        if not 0 < self.panic_window_s <= self.stable_window_s:
            raise ValueError("the panic window must be positive and no longer than the stable window")


@dataclass(frozen=True)
class TenantLimits:
    weight: float = 1.0
    min_workers: int = 0
    max_workers: int | None = None

    def __post_init__(self) -> None:
        if self.weight <= 0 or self.min_workers < 0:
            raise ValueError("a tenant's weight must be positive and its min_workers non-negative")
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError("a tenant's max_workers is below its min_workers")


@dataclass(frozen=True)
class ScaleDecision:
    total: int
    per_tenant: dict[str, int]
    panic: bool
    # Workers the demand of this instant needs (within the tenants' bounds and the pool's maximum).
    now: int = 0


@dataclass(frozen=True)
class ScalePlan:
    spawn: int
    retire: list[str]
    decision: ScaleDecision


def weighted_fill(demand: Mapping[str, int], weight: Mapping[str, float], capacity: int) -> dict[str, int]:
    """Integer weighted max-min fair shares: each unit goes to the unmet tenant with least (share+1)/weight."""
    alloc = dict.fromkeys(demand, 0)
    heap = [(1 / weight[t], t) for t, d in demand.items() if d > 0]
    heapq.heapify(heap)
    left = capacity
    while heap and left > 0:
        _, t = heapq.heappop(heap)
        alloc[t] += 1
        left -= 1
        if alloc[t] < demand[t]:
            heapq.heappush(heap, ((alloc[t] + 1) / weight[t], t))
    return alloc


@dataclass
class _Tenant:
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    last_demand_at: float | None = None

    def mean(self, now: float, window_s: float) -> float:
        vals = [c for t, c in self.samples if t > now - window_s]
        return sum(vals) / len(vals) if vals else 0.0


class Autoscaler:
    def __init__(
        self,
        policy: ScalePolicy,
        limits: Mapping[str, TenantLimits] | None = None,
        default: TenantLimits = TenantLimits(),
    ) -> None:
        self.policy = policy
        self.limits = dict(limits or {})
        self.default = default
        self._tenants: dict[str, _Tenant] = {t: _Tenant() for t in self.limits}
        self._panic_until: float | None = None
        self._last_total = 0

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, self.default)

    def observe(self, now: float, tenant: str, concurrency: float) -> None:
        st = self._tenants.setdefault(tenant, _Tenant())
        st.samples.append((now, concurrency))
        while st.samples and st.samples[0][0] <= now - self.policy.stable_window_s:
            st.samples.popleft()
        if concurrency > 0:
            st.last_demand_at = now

    def decide(self, now: float, current: int) -> ScaleDecision:
        p = self.policy
        stable: dict[str, int] = {}
        panic: dict[str, int] = {}
        instant: dict[str, int] = {}
        for name, st in self._tenants.items():
            lim = self.limits_of(name)
            idle = st.last_demand_at is None or now - st.last_demand_at >= p.scale_to_zero_grace_s
            cap = p.max_workers if lim.max_workers is None else lim.max_workers
            want_s = math.ceil(st.mean(now, p.stable_window_s) / p.target - 1e-9)
            want_p = math.ceil(st.mean(now, p.panic_window_s) / p.target - 1e-9)
            if idle:
                want_s = want_p = 0
            elif st.samples and st.samples[-1][1] > 0:
                # Demand right now needs a worker even before the averages see it (scale from zero).
                want_s, want_p = max(want_s, 1), max(want_p, 1)
            now_c = st.samples[-1][1] if st.samples else 0.0
            stable[name] = max(lim.min_workers, min(cap, want_s))
            panic[name] = max(lim.min_workers, min(cap, want_p))
            instant[name] = max(lim.min_workers, min(cap, math.ceil(now_c / p.target - 1e-9)))
        weights = {t: self.limits_of(t).weight for t in self._tenants}
        want_panic = sum(panic.values())
        if current > 0 and want_panic >= p.panic_threshold * current:
            self._panic_until = now + p.stable_window_s
        in_panic = self._panic_until is not None and now < self._panic_until
        if in_panic:
            demand = {t: max(stable[t], panic[t]) for t in stable}
            alloc = weighted_fill(demand, weights, p.max_workers)
            # In a burst the pool only grows: shrinking now would thrash against the next arrivals.
            total = max(sum(alloc.values()), min(self._last_total, p.max_workers))
        else:
            self._panic_until = None
            alloc = weighted_fill(stable, weights, p.max_workers)
            total = sum(alloc.values())
        self._last_total = total
        need = sum(weighted_fill(instant, weights, p.max_workers).values())
        return ScaleDecision(total, alloc, in_panic, min(need, total))

    def plan(self, now: float, idle_for: Mapping[str, float | None], keepalive_s: float) -> ScalePlan:
        """Workers to start and to retire. ``idle_for``: each live worker's idle seconds (None: busy)."""
        d = self.decide(now, len(idle_for))
        live = len(idle_for)
        spawn = max(0, d.now - live)
        idle = sorted(((s, w) for w, s in idle_for.items() if s is not None), reverse=True)
        retire: list[str] = []
        for s, w in idle:
            if live - len(retire) > d.total or (live - len(retire) > d.now and s >= keepalive_s):
                retire.append(w)
        return ScalePlan(spawn, retire, d)

    @property
    def tenants(self) -> list[str]:
        return list(self._tenants)

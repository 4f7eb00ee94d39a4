"""Weighted fair sharing of reward workers between tenants: start-time fair queueing (Goyal et al., 1996).

Each tenant has a virtual time that advances by the cost of what it was served divided by its weight; the
next free worker slot goes to the backlogged tenant with the smallest virtual time. Costs are not known
before a request runs, so a dispatch is charged the tenant's running estimate and corrected by the actual
cost when it finishes. No tenant's virtual time is behind the system's (the start tag of the last dispatch),
so idling banks no credit and a newcomer cannot starve the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class FairQueue:
    def __init__(self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0) -> None:
        self.weights = dict(weights or {})
        self.default_weight = default_weight
        self.vtime: dict[str, float] = {}
        self.system = 0.0
        self._cost: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def estimate(self, tenant: str) -> float:
        return self._cost.get(tenant, 1.0)

    def pick(self, backlogged: Iterable[str]) -> str | None:
        ready = list(backlogged)
        if not ready:
            return None
        for t in ready:
            self.vtime[t] = max(self.vtime.get(t, self.system), self.system)
        best = min(ready, key=lambda t: (self.vtime[t], t))
        self.system = self.vtime[best]
        return best

    def charge(self, tenant: str) -> float:
        """Account a dispatch at the tenant's estimated cost; returns the estimate to settle later."""
        est = self.estimate(tenant)
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + est / self.weight(tenant)
        return est

    def settle(self, tenant: str, estimated: float, actual: float, smoothing: float = 0.2) -> None:
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + (actual - estimated) / self.weight(tenant)
        prev = self._cost.get(tenant)
        self._cost[tenant] = actual if prev is None else (1 - smoothing) * prev + smoothing * actual

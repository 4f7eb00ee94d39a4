"""The reward pool's pure policies: the autoscaler (KPA windows, scale to zero, tenant bounds, keep-alive),
weighted max-min shares against brute force, and start-time fair queueing's weighted shares."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from loom.policies.autoscaler import Autoscaler, ScalePolicy, TenantLimits, weighted_fill
from loom.policies.fairshare import FairQueue

POLICY = ScalePolicy(
    target=2.0, stable_window_s=2.0, panic_window_s=0.5, scale_to_zero_grace_s=1.0, max_workers=8
)


def _feed(a: Autoscaler, t0: float, t1: float, demand: dict[str, float], dt: float = 0.1) -> float:
    t = t0
    while t < t1:
        for name, c in demand.items():
            a.observe(t, name, c)
        t += dt
    return t


def test_scales_up_on_a_burst_and_to_zero_after_the_grace() -> None:
    a = Autoscaler(POLICY)
    t = _feed(a, 0.0, 0.05, {"x": 12})
    d = a.decide(t, 0)
    assert d.total == 6 and d.now == 6  # 12 concurrent / target 2, from zero at once
    t = _feed(a, t, 3.0, {"x": 12})
    assert a.decide(t, 6).total == 6
    t = _feed(a, t, t + 0.5, {"x": 0})
    assert a.decide(t, 6).now == 0  # nothing needed this instant; the window still holds some
    t = _feed(a, t, t + 3.0, {"x": 0})
    assert a.decide(t, 6).total == 0


def test_panic_grows_at_once_and_never_shrinks_while_it_lasts() -> None:
    a = Autoscaler(POLICY)
    t = _feed(a, 0.0, 3.0, {"x": 2})
    assert a.decide(t, 1).total == 1
    t = _feed(a, t, t + 0.3, {"x": 16})
    d = a.decide(t, 1)
    # The 2 s stable window would still say 3; the 0.5 s panic window sees the burst.
    assert d.panic and d.total >= 6
    t = _feed(a, t, t + 0.6, {"x": 1})
    assert a.decide(t, d.total).total == d.total  # still panicking: the burst may come back


def test_tenant_bounds_and_weighted_split_of_the_pool() -> None:
    limits = {"a": TenantLimits(weight=3.0), "b": TenantLimits(weight=1.0), "c": TenantLimits(min_workers=1)}
    a = Autoscaler(POLICY, limits, default=TenantLimits(max_workers=2))
    t = _feed(a, 0.0, 2.5, {"a": 100, "b": 100, "d": 100})
    d = a.decide(t, 8)
    assert d.total == 8 and d.per_tenant["c"] == 1 and d.per_tenant["d"] <= 2
    assert d.per_tenant["a"] > d.per_tenant["b"]


def test_plan_retires_idle_workers_after_the_keepalive_only_beyond_the_need() -> None:
    a = Autoscaler(POLICY)
    t = _feed(a, 0.0, 2.5, {"x": 4})  # needs 2 workers
    idle = {"w1": None, "w2": 0.5, "w3": 0.01, "w4": 0.3}
    plan = a.plan(t, idle, keepalive_s=0.1)
    assert plan.spawn == 0 and set(plan.retire) == {"w2", "w4"}
    t = _feed(a, t, t + 0.2, {"x": 10})
    # Growth follows the panic window (mean 6.4 concurrent -> 4 workers), not the instant's 5.
    grow = a.plan(t, {"w1": None, "w3": None}, 0.1)
    assert grow.decision.panic and grow.spawn == 2


@settings(max_examples=300, deadline=None)
@given(
    demand=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    weight=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=4, max_size=4),
    cap=st.integers(0, 12),
)
def test_weighted_fill_is_work_conserving_and_fair_to_one_unit(
    demand: list[int], weight: list[float], cap: int
) -> None:
    names = [f"t{i}" for i in range(len(demand))]
    d = dict(zip(names, demand, strict=True))
    w = dict(zip(names, weight, strict=False))
    got = weighted_fill(d, w, cap)
    assert sum(got.values()) == min(cap, sum(demand)) and all(0 <= got[n] <= d[n] for n in names)
    # D'Hondt's fairness: a tenant left short could not take a unit from anyone without ending up
    # with more per weight than they keep.
    for t in names:
        if got[t] < d[t]:
            assert all(got[u] / w[u] <= (got[t] + 1) / w[t] + 1e-9 for u in names), got
    # Brute force: no other work-conserving allocation has a smaller largest share per weight.
    best = min(
        max((x / w[n] for n, x in zip(names, a, strict=True)), default=0.0)
        for a in itertools.product(*(range(x + 1) for x in demand))
        if sum(a) == min(cap, sum(demand))
    )
    assert max((got[n] / w[n] for n in names), default=0.0) == best


@settings(max_examples=100, deadline=None)
@given(
    weights=st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=2, max_size=4),
    costs=st.lists(st.floats(0.5, 3.0), min_size=4, max_size=4),
    late=st.integers(0, 300),
)
def test_fair_queue_serves_backlogged_tenants_in_proportion_to_weight(
    weights: list[float], costs: list[float], late: int
) -> None:
    names = [f"t{i}" for i in range(len(weights))]
    fq = FairQueue(dict(zip(names, weights, strict=True)))
    served = dict.fromkeys(names, 0.0)
    for step in range(2000):
        # The last tenant joins late: it must not be owed the time it was away.
        ready = names if step >= late else names[:-1]
        t = fq.pick(ready)
        assert t is not None
        est = fq.charge(t)
        cost = costs[names.index(t)]
        fq.settle(t, est, cost)
        if step >= late + 200:
            served[t] += cost
    total_w = sum(weights)
    total = sum(served.values())
    for n, wt in zip(names, weights, strict=True):
        assert abs(served[n] / total - wt / total_w) < 0.05, (served, weights)

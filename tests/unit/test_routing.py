"""Each routing baseline pinned to its documented behaviour."""

from __future__ import annotations

from collections import Counter

import pytest

from loom.policies.ordering import Plas, RequestMeta, make_order
from loom.policies.queueing import AdmissionQueue
from loom.policies.routing import CacheAware, LeastLoad, RouterView, VerlSticky, make_routing

W = ["w0", "w1", "w2", "w3"]


def test_verl_is_sticky_and_balances_first_requests_by_assignment_count() -> None:
    p = VerlSticky(W, seed=1)
    idle = RouterView(W, {})
    first = {f"t{i}": p.choose(f"t{i}", 100, idle) for i in range(8)}
    assert Counter(first.values()) == Counter({w: 2 for w in W})  # 8 trajectories, 2 each
    # Sticky whatever the load: later steps go where the first one went.
    busy = RouterView(W, {first["t0"]: 500})
    assert all(p.choose("t0", 100 + 50 * k, busy) == first["t0"] for k in range(5))
    # Counts never go down: finished trajectories still count, so a new one avoids nobody in particular.
    p.forget("t0")
    assert Counter(p.choose(f"n{i}", 1, idle) for i in range(4)) == Counter({w: 1 for w in W})


def test_slime_picks_the_least_loaded_worker_at_every_step() -> None:
    p = LeastLoad()
    assert p.choose("t", 100, RouterView(W, {"w0": 3, "w1": 1, "w2": 1, "w3": 2})) == "w1"
    assert p.choose("t", 200, RouterView(W, {"w0": 0, "w1": 5, "w2": 1, "w3": 2})) == "w0"


def test_cache_aware_follows_the_prefix_until_skew_exceeds_32() -> None:
    p = CacheAware.verl_star()
    balanced = RouterView(W, {"w0": 10, "w1": 5, "w2": 5, "w3": 5})
    home = p.choose("t", 1000, balanced)  # nothing cached: the worker with the least text (first)
    assert home == "w0"
    assert p.choose("t", 1500, RouterView(W, {"w0": 30, "w1": 0, "w2": 0, "w3": 0})) == home  # skew 30
    assert p.choose("t", 1800, RouterView(W, {"w0": 32, "w1": 0, "w2": 0, "w3": 0})) == home  # 32: not > 32
    skewed = RouterView(W, {"w0": 34, "w1": 2, "w2": 1, "w3": 4})
    assert p.imbalanced(skewed) and p.choose("t", 2000, skewed) == "w2"  # 34 - 1 > 32: least load
    # A prefix match below the threshold goes to the worker owning the least text.
    p2 = CacheAware.verl_star()
    p2.choose("a", 1000, balanced)
    assert p2.choose("a", 5000, balanced) != "w0"  # match 0.2 <= 0.5


def test_current_sglang_defaults_need_a_relative_skew_too() -> None:
    p = CacheAware.sglang_default()
    assert not p.imbalanced(RouterView(W, {"w0": 200, "w1": 150, "w2": 150, "w3": 150}))  # 200 < 1.5 * 150
    assert p.imbalanced(RouterView(W, {"w0": 200, "w1": 100, "w2": 150, "w3": 150}))


def test_autellix_serves_the_least_served_program_first_and_promotes_starving_calls() -> None:
    order = Plas(first_quantum=100, levels=4, beta=2.0)
    assert order.bounds == [100, 300, 700] and [order.level(x) for x in (0, 99, 100, 650, 10**6)] == [
        0,
        0,
        1,
        2,
        3,
    ]
    q: AdmissionQueue[None] = AdmissionQueue(order)
    q.push("heavy", None, RequestMeta("h", 5, attained=5000, attained_s=10.0, arrival=0.0))
    q.push("light", None, RequestMeta("l", 1, attained=50, attained_s=0.1, arrival=1.0))
    assert q.ordered() == ["light", "heavy"]
    order.now = 25.0  # heavy has waited 25 s >= 2 x its 10 s of service: promoted
    q.rekey_all()
    assert q.ordered() == ["heavy", "light"]


def test_factories_name_every_baseline() -> None:
    for name in ("verl", "slime", "verl_star", "sglang_cache_aware"):
        assert make_routing(name, W).name == name
    for name in ("fcfs", "rr", "pps", "autellix"):
        assert make_order(name).name == name
    with pytest.raises(ValueError):
        make_routing("magic", W)
    with pytest.raises(ValueError):
        make_order("magic")

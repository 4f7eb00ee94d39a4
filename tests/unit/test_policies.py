from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loom.policies.placement import RoundRobinPlacement
from loom.policies.queueing import FcfsQueue


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(-10, 10)), max_size=60), st.data())
def test_fcfs_pops_in_arrival_order_whatever_the_priority(
    ops: list[tuple[int, float]], data: st.DataObject
) -> None:
    q: FcfsQueue[int] = FcfsQueue()
    order: list[str] = []
    for i, (rid_n, prio) in enumerate(ops):
        rid = f"r{rid_n}"
        if rid not in q and rid not in order:
            order.append(rid)
        q.push(rid, i, prio)
    removed = set(data.draw(st.lists(st.sampled_from(order), unique=True)) if order else [])
    for rid in removed:
        assert q.remove(rid) is not None
    out = []
    while (item := q.pop()) is not None:
        out.append(item[0])
    assert out == [r for r in order if r not in removed]
    assert len(q) == 0


def test_round_robin_spreads_evenly_and_continues() -> None:
    rr = RoundRobinPlacement()
    plan = rr.place([f"t{i}" for i in range(10)], ["w1", "w0", "w2"])
    counts = {w: list(plan.values()).count(w) for w in ("w0", "w1", "w2")}
    assert counts == {"w0": 4, "w1": 3, "w2": 3}
    assert plan["t0"] == "w0" and plan["t1"] == "w1" and plan["t3"] == "w0"
    assert rr.place(["late"], ["w0", "w1", "w2"]) == {"late": "w1"}


def test_replacement_goes_to_least_loaded() -> None:
    rr = RoundRobinPlacement()
    assert rr.place_one("t", ["w0", "w1", "w2"], {"w0": 5, "w1": 1, "w2": 1}) == "w1"

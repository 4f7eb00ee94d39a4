from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loom.policies.ordering import Fcfs, Pps, RequestMeta, RoundRobin, held, preemption_victim
from loom.policies.placement import RoundRobinPlacement
from loom.policies.queueing import AdmissionQueue, WorkerQueue


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(-10, 10)), max_size=60), st.data())
def test_fcfs_pops_in_arrival_order_whatever_the_priority(
    ops: list[tuple[int, float]], data: st.DataObject
) -> None:
    q: AdmissionQueue[int] = AdmissionQueue(Fcfs())
    order: list[str] = []
    for i, (rid_n, prio) in enumerate(ops):
        rid = f"r{rid_n}"
        if rid not in q and rid not in order:
            order.append(rid)
        q.push(rid, i, RequestMeta(traj=rid, step=0, priority=prio, traj_arrival=float(i)))
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


def _meta(traj: str, step: int, prio: float, traj_arrival: float, arrival: float) -> RequestMeta:
    return RequestMeta(traj=traj, step=step, priority=prio, traj_arrival=traj_arrival, arrival=arrival)


def test_orders_differ_as_documented() -> None:
    # "a" started first and is back from a tool call (step 3); "b" and "c" are newer trajectories.
    reqs = [("b0", _meta("b", 0, 10, 5, 5)), ("a3", _meta("a", 3, 1, 0, 6)), ("c0", _meta("c", 0, 99, 7, 7))]
    got = {}
    for policy in (Fcfs(), RoundRobin(), Pps()):
        q: AdmissionQueue[None] = AdmissionQueue(policy)
        for rid, m in reqs:
            q.push(rid, None, m)
        got[policy.name] = q.ordered()
    assert got["fcfs"] == ["a3", "b0", "c0"]  # a keeps its place across steps
    assert got["rr"] == ["b0", "a3", "c0"]  # a went to the tail after its tool call
    assert got["pps"] == ["c0", "b0", "a3"]  # longest predicted first


def test_a_priority_update_reorders_the_queue() -> None:
    q: AdmissionQueue[None] = AdmissionQueue(Pps())
    for i, t in enumerate("xyz"):
        q.push(f"{t}.0", None, _meta(t, 0, 100 - i, i, i))
    assert q.ordered() == ["x.0", "y.0", "z.0"]
    assert q.reprioritize("z", 1000) == 1
    assert q.ordered() == ["z.0", "x.0", "y.0"]
    assert q.pop() == ("z.0", None) and len(q) == 2


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=30))
def test_a_pps_priority_is_the_longest_estimate_so_far(estimates: list[float]) -> None:
    prio: float | None = None
    seen = []
    for e in estimates:
        prio = held(prio, e)
        seen.append(prio)
        assert prio == max(estimates[: len(seen)])  # brute force: the running maximum
    assert seen == sorted(seen)  # never falls: a lower estimate does not cost a trajectory its place
    if estimates == sorted(estimates):
        assert seen == estimates  # estimates that only grow (an exact one, a survivor's) pass unchanged


def test_preemption_follows_algorithm_1() -> None:
    running = [("r1", 50.0), ("r2", 5.0), ("r3", 70.0)]
    assert preemption_victim(60.0, running) == "r2"
    assert preemption_victim(5.0, running) is None  # ties do not preempt
    assert preemption_victim(1e9, []) is None


def test_worker_queue_serves_jobs_round_robin_each_in_its_own_order() -> None:
    q: WorkerQueue[None] = WorkerQueue()
    for i in range(3):
        q.push("big", f"big{i}", None, _meta(f"b{i}", 0, float(i), float(i), float(i)), Pps())
    q.push("small", "small0", None, _meta("s0", 0, 0.0, 9.0, 9.0), Fcfs())
    out = []
    while (item := q.pop()) is not None:
        out.append(item[0])
    assert out == ["big2", "small0", "big1", "big0"]  # alternating jobs; "big" longest first
    q.push("a", "x", None, _meta("x", 0, 1, 0, 0), Pps())
    assert "x" in q and q.remove("x") is None and "x" not in q and len(q) == 0

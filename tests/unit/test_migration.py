from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loom.policies.migration import MigrationPlanner, Move, schedule_transfers


def _planner(jump: float = 0.0) -> MigrationPlanner:
    # Planned: 1 trajectory on the fast worker A, 3 on B, 6 on C (longest first).
    p = MigrationPlanner(["A", "B", "C"], [1, 3, 6], jump=jump)
    lengths = [100, 90, 80, 70, 60, 50, 40, 30, 20, 10]
    plan = ["A", "B", "B", "B", "C", "C", "C", "C", "C", "C"]
    for i, (n, w) in enumerate(zip(lengths, plan, strict=True)):
        p.add(f"t{i}", n, w)
    return p


def test_a_prediction_jump_moves_a_trajectory_to_the_long_group() -> None:
    p = _planner()
    assert p.update("t5", 55) is None  # still ranked inside C's range
    mv = p.update("t9", 95)  # the shortest one turns out long: rank 1 -> B's range
    assert mv == Move("t9", "C", "B", 95)
    mv = p.update("t9", 500)  # now the longest of all -> A
    assert mv == Move("t9", "C", "A", 500)


def test_only_a_prediction_jump_moves_a_trajectory() -> None:
    p = _planner(jump=0.5)
    assert p.update("t9", 14) is None  # +40%: rank 8 -> still C, and below the jump anyway
    assert p.update("t4", 85) is None  # 60 -> 85 crosses into B's range but is only +42%
    assert p.update("t4", 95) == Move("t4", "C", "B", 95)  # +58% since it was placed
    p.moved("t4", "B")
    assert p.update("t4", 120) is None  # measured from where it was last placed: +26%


def test_a_move_never_overfills_its_destination() -> None:
    p = MigrationPlanner(["A", "B"], [2, 8], jump=0.0)
    for i in range(10):
        p.add(f"t{i}", 100 - i, "A" if i < 2 else "B")
    # A holds its 2: one of B's may move up (A then holds 3), the next may not.
    mv = p.update("t9", 1009)
    assert mv == Move("t9", "B", "A", 1009)
    p.moved("t9", "A")
    assert p.update("t8", 1008) is None
    p.finish("t0")
    p.finish("t1")  # 8 active: A's size scales to 1.6, and it holds 1 (t9): room again
    assert p.update("t8", 1010) == Move("t8", "B", "A", 1010)


@given(st.lists(st.tuples(st.integers(0, 19), st.floats(1, 1e5)), max_size=60))
def test_no_sequence_of_updates_overfills_a_worker(updates: list[tuple[int, float]]) -> None:
    p = MigrationPlanner(["A", "B", "C"], [2, 6, 12], jump=0.0)
    for i in range(20):
        p.add(f"t{i}", 100.0 - i, "A" if i < 2 else "B" if i < 8 else "C")
    for i, n in updates:
        mv = p.update(f"t{i}", n)
        if mv is not None:
            p.moved(mv.traj, mv.dst)
    for w in "ABC":  # each at most one past its planned size
        assert sum(1 for x in p.where.values() if x == w) <= p.capacity(w) + 1


def test_partition_sizes_scale_with_active_trajectories() -> None:
    p = _planner()
    for t in ("t0", "t1", "t2", "t3", "t4"):
        p.finish(t)
    # 5 of 10 remain: scaled sizes 0.5, 1.5, 3 -> rank 0 -> A, rank 1 -> B, ranks 2..4 -> C.
    assert [p.target(r) for r in range(5)] == ["A", "B", "C", "C", "C"]
    assert p.rank("t5") == 0 and p.active == 5


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.floats(1, 1e5)), max_size=40))
def test_transfer_batches_never_reuse_an_endpoint(moves: list[tuple[int, int, float]]) -> None:
    pending = [Move(f"t{i}", f"w{a}", f"w{b}", n) for i, (a, b, n) in enumerate(moves) if a != b]
    batch = schedule_transfers(pending, busy=["w5"])
    ends = [e for m in batch for e in (m.src, m.dst)]
    assert len(ends) == len(set(ends)) and "w5" not in ends
    # Greedy longest first: every skipped move conflicts with a longer (or equal) selected one.
    chosen = {m.traj for m in batch}
    for m in pending:
        if m.traj not in chosen and "w5" not in (m.src, m.dst):
            assert any({m.src, m.dst} & {c.src, c.dst} and c.length >= m.length for c in batch)

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

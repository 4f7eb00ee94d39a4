"""Loom's own hardware-affinity mapping from the engine model: the tail task where it runs fastest, the rest
where they cost least without becoming the tail."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.bench.harness.mapping import choose_affinity
from loom.workloads.base import WorkStep, WorkTraj


def _traj(task: str, i: int, turns: int, out: int, tool_s: float) -> WorkTraj:
    steps = tuple(WorkStep(1000 + k * (out + 200), out, tool_s) for k in range(turns))
    return WorkTraj(f"{task}{i}", f"{task}{i}", 0, steps, task=task)


def test_the_long_agent_goes_to_h800_and_the_short_ones_to_the_cheaper_h20() -> None:
    trajs = [_traj("coding", i, 30, 600, 0.4) for i in range(3)]
    trajs += [_traj("math", i, 2, 300, 0.05) for i in range(20)]
    c = choose_affinity(trajs, "qwen3-8b", {"h800": 1, "h20": 1})
    assert c.critical == "coding" and c.affinity == {"coding": "h800", "default": "h20"}
    # The reasons carry the figures the choice rests on.
    assert "coding sets the step's tail" in c.reasons[0] and "math costs" in c.reasons[1]
    assert c.table["coding"]["h800"].floor_s < c.table["coding"]["h20"].floor_s
    assert c.table["math"]["h20"].cost < c.table["math"]["h800"].cost
    with pytest.raises(ValueError, match="no price"):
        choose_affinity(trajs, "qwen3-8b", {"b200": 1})


@settings(max_examples=30, deadline=None)
@given(
    tasks=st.lists(
        st.tuples(st.integers(1, 40), st.integers(50, 2000), st.floats(0, 3)), min_size=1, max_size=4
    )
)
def test_no_task_is_sent_where_it_would_outlast_the_tail_task(tasks: list[tuple[int, int, float]]) -> None:
    trajs = [_traj(f"t{k}", 0, turns, out, tool) for k, (turns, out, tool) in enumerate(tasks)]
    c = choose_affinity(trajs, "qwen3-8b", {"h800": 1, "h20": 1})
    home = c.affinity.get(c.critical, c.affinity["default"])
    bound = c.table[c.critical][home].floor_s
    assert bound == min(v.floor_s for v in c.table[c.critical].values())
    for task, row in c.table.items():
        gpu = c.affinity.get(task, c.affinity["default"])
        # Within the tail whenever some GPU type keeps it there.
        if min(v.floor_s for v in row.values()) <= bound:
            assert row[gpu].floor_s <= bound * (1 + 1e-12)

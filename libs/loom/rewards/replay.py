"""Trace-replay reward: the recorded outcome (SWE-bench ``resolved``) of the replayed trajectory."""

from __future__ import annotations

from pathlib import Path

from loom.data.traces import load_traces
from loom.protocol import Trajectory
from loom.rewards.context import RewardError


def replay_reward(traj: Trajectory, traces_path: str | Path | None = None) -> float:
    trace_id = traj.info.get("trace_id")
    if not isinstance(trace_id, str):
        raise RewardError(f"trajectory {traj.traj_id} has no trace_id")
    trace = load_traces(traces_path).get(trace_id)
    if trace is None:
        raise RewardError(f"unknown trace {trace_id!r}")
    # A replay cut short by max_turns/max_tokens did not reach the recorded submission.
    completed = len(traj.steps) == len(trace.steps)
    return 1.0 if (trace.resolved and completed) else 0.0

"""Rewards decided inside the environment: the task's tests (code), the gold answer (math, search).

The environment ran the check in the trajectory's own sandbox at submission; the verdict travels with
the trajectory and its ``score`` is the reward.
"""

from __future__ import annotations

from loom.protocol import Trajectory
from loom.rewards.context import RewardError


def env_verdict(traj: Trajectory) -> float:
    verdict = traj.info.get("verdict")
    if not isinstance(verdict, dict) or not isinstance(verdict.get("score"), int | float):
        raise RewardError(f"trajectory {traj.traj_id} carries no verdict from its {traj.env} environment")
    return float(verdict["score"])

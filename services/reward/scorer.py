"""Scoring: which reward function applies to a trajectory."""

from __future__ import annotations

from loom.protocol import RewardRequest
from loom.rewards.env_verdict import ENV_VERDICTS, env_verdict
from loom.rewards.replay import replay_reward


class UnknownReward(ValueError):
    pass


def score(req: RewardRequest) -> float | None:
    """The reward, or None for a trajectory that did not complete (it is stored, unscored)."""
    traj = req.trajectory
    if traj.status != "completed":
        return None
    if req.kind == "replay":
        return replay_reward(traj, traj.info.get("traces_path"))
    if req.kind in ENV_VERDICTS:
        return env_verdict(traj)
    raise UnknownReward(f"no reward function {req.kind!r}")

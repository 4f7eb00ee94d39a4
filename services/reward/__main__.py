"""Reward service: scores finished trajectories in autoscaled worker processes and stores them in the
job's result stream."""

from __future__ import annotations

from loom.runtime import service
from services.reward.service import RewardService
from services.reward.settings import RewardSettings


def main() -> None:
    service.main("reward", RewardSettings, lambda rt: RewardService(rt, rt.settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

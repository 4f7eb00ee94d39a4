"""Simulated time for services that model GPUs and tools.

Every process of one deployment shares ``epoch`` (wall time when the deployment started) and ``speed``,
so timestamps taken in different processes agree: sim_now = epoch + (wall_now - epoch) * speed.
"""

from __future__ import annotations

import asyncio
import time


class Clock:
    def __init__(self, speed: float = 1.0, epoch: float | None = None) -> None:
        if speed <= 0:
            raise ValueError(f"clock speed must be positive, got {speed}")
        self.speed = speed
        self.epoch = time.time() if epoch is None else epoch

    def now(self) -> float:
        """Simulated seconds (Unix-epoch based)."""
        return self.epoch + (time.time() - self.epoch) * self.speed

    def to_wall(self, sim_seconds: float) -> float:
        return sim_seconds / self.speed

    def to_sim(self, wall_seconds: float) -> float:
        return wall_seconds * self.speed

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(max(0.0, sim_seconds) / self.speed)

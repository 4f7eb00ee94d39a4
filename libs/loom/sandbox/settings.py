"""Sandbox settings shared by the services that run untrusted code (environment manager, reward workers)."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from pydantic import Field

from loom.sandbox.engine import choose_backend
from loom.sandbox.images import DEFAULT_IMAGE
from loom.sandbox.pool import SandboxPool
from loom.sandbox.types import Limits
from loom.settings import LoomSettings

log = logging.getLogger(__name__)


class SandboxSettings(LoomSettings):
    # Docker when an engine answers, else processes with rlimits (said loudly).
    sandbox_backend: Literal["auto", "docker", "process"] = "auto"
    sandbox_image: str = DEFAULT_IMAGE
    sandbox_warm: int = Field(8, ge=0)
    sandbox_max: int = Field(256, ge=1)
    sandbox_cpus: float = Field(1.0, gt=0)
    sandbox_memory_mb: int = Field(512, ge=16)
    sandbox_pids: int = Field(128, ge=8)


class OnDemandSandboxes:
    """A sandbox pool opened on first use, so that a service that never runs code needs no engine."""

    def __init__(self, settings: SandboxSettings, name: str) -> None:
        self.settings = settings
        self.name = name
        self.pool: SandboxPool | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> SandboxPool:
        async with self._lock:
            if self.pool is None:
                s = self.settings
                backend = await choose_backend(s.sandbox_backend, image=s.sandbox_image, pool=self.name)
                limits = Limits(cpus=s.sandbox_cpus, memory_mb=s.sandbox_memory_mb, pids=s.sandbox_pids)
                pool = SandboxPool(backend, limits, warm=s.sandbox_warm, max_sandboxes=s.sandbox_max)
                try:
                    await pool.start()
                except BaseException:
                    await backend.close()
                    raise
                self.pool = pool
                log.info("sandboxes for %s: %s backend, %d warm", self.name, backend.name, s.sandbox_warm)
            return self.pool

    async def close(self) -> None:
        """Close the pool (if it was ever opened), then its backend."""
        if self.pool is not None:
            await self.pool.close()
            await self.pool.backend.close()

"""Sandbox settings shared by the services that run untrusted code (environment manager, reward workers)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loom.sandbox.engine import choose_backend
from loom.sandbox.images import DEFAULT_IMAGE
from loom.sandbox.pool import SandboxPool
from loom.sandbox.types import Limits
from loom.settings import LoomSettings


class SandboxSettings(LoomSettings):
    # Docker when an engine answers, else processes with rlimits (said loudly).
    sandbox_backend: Literal["auto", "docker", "process"] = "auto"
    sandbox_image: str = DEFAULT_IMAGE
    sandbox_warm: int = Field(8, ge=0)
    sandbox_max: int = Field(256, ge=1)
    sandbox_cpus: float = Field(1.0, gt=0)
    sandbox_memory_mb: int = Field(512, ge=16)
    sandbox_pids: int = Field(128, ge=8)

    async def open_sandbox_pool(self, pool: str) -> SandboxPool:
        """A started pool on the chosen backend; the caller closes the pool, then its backend."""
        backend = await choose_backend(self.sandbox_backend, image=self.sandbox_image, pool=pool)
        limits = Limits(cpus=self.sandbox_cpus, memory_mb=self.sandbox_memory_mb, pids=self.sandbox_pids)
        sp = SandboxPool(backend, limits, warm=self.sandbox_warm, max_sandboxes=self.sandbox_max)
        try:
            await sp.start()
        except BaseException:
            await backend.close()
            raise
        return sp

"""The trainer's side of co-scheduling (RollMux's phase shim): wait for a permit, warm-start, run, offload.

A trainer registered with ``POST /v1/rljobs`` wraps each phase::

    client = PhaseClient(nc, "my-job", on_load=load_from_dram, on_offload=offload_to_dram)
    await client.start()
    async with client.phase("rollout") as permit:   # blocks until the group's round robin says go
        ...generate, calling await client.progress(done / total) now and then...
    async with client.phase("train"):
        ...

or decorates a phase function with ``@client.phase_fn("train")``. ``on_load(phase, permit)`` runs after the
permit and before the body (load the phase's resident state from host memory onto the GPUs);
``on_offload(phase)`` runs after the body and before the release (move the updated state back), so the next
job in the group starts on free GPUs. ``on_migrate(TailMigration)`` is told when a rollout's tail must
shrink onto fewer GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from loom.protocol import (
    PhaseAck,
    PhaseDone,
    PhasePermit,
    PhaseProgress,
    PhaseRequest,
    TailMigration,
    decode,
    encode,
    subjects,
)
from loom.runtime import bus
from loom.runtime.leader import ask_active

T = TypeVar("T")
Hook = Callable[..., Awaitable[None] | None]


class PhaseError(RuntimeError):
    pass


async def _call(hook: Hook | None, *args: Any) -> None:
    if hook is not None:
        result = hook(*args)
        if inspect.isawaitable(result):
            await result


class PhaseClient:
    def __init__(
        self,
        nc: NATS,
        job: str,
        *,
        on_load: Hook | None = None,
        on_offload: Hook | None = None,
        on_migrate: Hook | None = None,
        request_timeout_s: float = 5.0,
    ) -> None:
        self.nc = nc
        self.job = job
        self.on_load, self.on_offload, self.on_migrate = on_load, on_offload, on_migrate
        self.request_timeout_s = request_timeout_s
        self._permits: dict[str, asyncio.Queue[PhasePermit]] = {
            "rollout": asyncio.Queue(),
            "train": asyncio.Queue(),
        }
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        """Listen for permits and migrations; call before the first ``acquire``."""

        async def on_permit(msg: Msg) -> None:
            p = decode(msg.data, PhasePermit)
            self._permits[p.phase].put_nowait(p)

        async def on_migrate(msg: Msg) -> None:
            await _call(self.on_migrate, decode(msg.data, TailMigration))

        self._subs.append(await self.nc.subscribe(subjects.phase_permit(self.job), cb=on_permit))
        self._subs.append(await self.nc.subscribe(subjects.tail_migration(self.job), cb=on_migrate))
        await self.nc.flush()

    async def close(self) -> None:
        for s in self._subs:
            await s.unsubscribe()
        self._subs.clear()

    async def _ask(self, subject: str, payload: Any) -> PhaseAck:
        # Through a scheduler takeover, as the trainer SDK asks: a co-scheduled job outlives its scheduler.
        try:
            return await ask_active(self.nc, subject, payload, PhaseAck, self.request_timeout_s)
        except bus.BusError as e:
            raise PhaseError(f"{e.code}: {e.message}") from None

    async def acquire(self, phase: str, timeout_s: float | None = None) -> PhasePermit:
        """Ask for ``phase`` and wait for its permit (the group's round robin decides when)."""
        if phase not in self._permits:
            raise ValueError(f"phase must be rollout or train, not {phase!r}")
        if not self._subs:
            raise PhaseError("call start() before acquire()")
        await self._ask(subjects.PHASE_REQUEST, PhaseRequest(self.job, phase))  # type: ignore[arg-type]
        return await asyncio.wait_for(self._permits[phase].get(), timeout_s)

    async def release(self, phase: str) -> None:
        await self._ask(subjects.PHASE_DONE, PhaseDone(self.job, phase))  # type: ignore[arg-type]

    async def progress(self, done_fraction: float) -> None:
        """Share of the running rollout's responses done (drives long-tail migration)."""
        await self.nc.publish(subjects.PHASE_PROGRESS, encode(PhaseProgress(self.job, done_fraction)))

    @contextlib.asynccontextmanager
    async def phase(self, name: str, timeout_s: float | None = None) -> AsyncIterator[PhasePermit]:
        permit = await self.acquire(name, timeout_s)
        try:
            await _call(self.on_load, name, permit)
            yield permit
        finally:
            try:
                await _call(self.on_offload, name)
            finally:
                await self.release(name)

    def phase_fn(self, name: str) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
        """Decorator form of ``phase``: the function runs holding the permit."""

        def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
            @functools.wraps(fn)
            async def run(*args: Any, **kwargs: Any) -> T:
                async with self.phase(name):
                    return await fn(*args, **kwargs)

            return run

        return wrap

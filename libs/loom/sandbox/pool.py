"""A warm pool of sandboxes with per-session affinity.

A session (a trajectory, or a reward request) gets a fresh sandbox from the warm pool on its first call
and the same one on every later call; releasing the session destroys the sandbox, so nothing one
trajectory did is seen by another. The pool refills in the background so that a session's first call
does not pay for a container start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from loom.sandbox.types import Limits, Sandbox, SandboxError

log = logging.getLogger(__name__)


class Backend(Protocol):
    name: str

    async def check(self) -> None: ...

    async def create(self, limits: Limits) -> Sandbox: ...

    async def reap(self) -> int: ...

    async def close(self) -> None: ...


@dataclass
class PoolStats:
    warm: int = 0
    in_use: int = 0
    creating: int = 0
    created: int = 0
    cold_starts: int = 0
    create_failures: int = 0
    reaped: int = 0


@dataclass
class _Warm:
    sandbox: Sandbox
    born: float


class SandboxPool:
    """Sandboxes of one backend and one set of limits. The backend stays the caller's to close."""

    def __init__(
        self,
        backend: Backend,
        limits: Limits | None = None,
        *,
        warm: int = 4,
        max_sandboxes: int = 256,
        create_concurrency: int = 4,
        max_warm_age_s: float = 1800.0,
    ) -> None:
        if warm > max_sandboxes:
            raise ValueError(f"warm ({warm}) exceeds max_sandboxes ({max_sandboxes})")
        self.backend = backend
        self.limits = limits or Limits()
        self.warm_target = warm
        self.max_sandboxes = max_sandboxes
        self.max_warm_age_s = max_warm_age_s
        self.sessions: dict[str, Sandbox] = {}
        self.stats = PoolStats()
        self._warm: list[_Warm] = []
        self._creating = 0
        self._create_sem = asyncio.Semaphore(create_concurrency)
        self._room = asyncio.Condition()
        self._session_locks: dict[str, asyncio.Lock] = {}
        self._refill_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._closed = False
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def _total(self) -> int:
        return len(self._warm) + len(self.sessions) + self._creating

    def snapshot(self) -> PoolStats:
        self.stats.warm, self.stats.in_use, self.stats.creating = (
            len(self._warm),
            len(self.sessions),
            self._creating,
        )
        return self.stats

    async def start(self) -> None:
        await self.backend.check()
        self.stats.reaped += await self.backend.reap()
        self._refill_task = asyncio.create_task(self._refill_forever(), name="sandbox-refill")
        self._wake.set()

    async def fill(self, timeout_s: float = 120.0) -> None:
        """Wait until the warm pool is full (benchmarks and tests start from a full pool)."""
        async with asyncio.timeout(timeout_s):
            while len(self._warm) < min(self.warm_target, self.max_sandboxes - len(self.sessions)):
                self._wake.set()
                await asyncio.sleep(0.05)

    async def _create(self) -> Sandbox:
        self._creating += 1
        try:
            async with self._create_sem:
                sb = await self.backend.create(self.limits)
            self.stats.created += 1
            return sb
        except SandboxError:
            self.stats.create_failures += 1
            raise
        finally:
            self._creating -= 1

    async def _refill_forever(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            want = min(
                self.warm_target - len(self._warm) - self._creating, self.max_sandboxes - self._total()
            )
            if want <= 0:
                continue
            results = await asyncio.gather(*(self._create() for _ in range(want)), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            for r in results:
                if not isinstance(r, BaseException):
                    if self._closed:
                        await r.close()
                    else:
                        self._warm.append(_Warm(r, time.monotonic()))
            if failed:
                log.warning("warm pool: %d sandbox starts failed: %s", len(failed), failed[0])
                await asyncio.sleep(1.0)  # an engine in trouble is not hammered
                self._wake.set()

    async def _take(self) -> Sandbox:
        now = time.monotonic()
        while self._warm:
            w = self._warm.pop()
            if now - w.born < self.max_warm_age_s:
                self._wake.set()
                return w.sandbox
            await w.sandbox.close()  # near the end of its life: the container's own timer would end it
        self.stats.cold_starts += 1
        self._wake.set()
        return await self._create()

    async def acquire(self, session: str) -> Sandbox:
        """The session's sandbox, made (or taken warm) on first use."""
        if self._closed:
            raise SandboxError("sandbox pool is closed")
        lock = self._session_locks.setdefault(session, asyncio.Lock())
        async with lock:
            if session in self.sessions:
                return self.sessions[session]
            async with self._room:
                await self._room.wait_for(lambda: self._warm or self._total() < self.max_sandboxes)
                # Claim the slot before creating so that concurrent sessions cannot overshoot the cap.
                self.sessions[session] = _PLACEHOLDER
            try:
                sb = await self._take()
            except BaseException:
                del self.sessions[session]
                await self._notify()
                raise
            self.sessions[session] = sb
            return sb

    async def release(self, session: str) -> None:
        """End the session: its sandbox is destroyed, never reused."""
        self._session_locks.pop(session, None)
        sb = self.sessions.pop(session, None)
        if sb is not None and sb is not _PLACEHOLDER:
            # Removal takes the engine a few hundred ms; the session's owner need not wait for it.
            t = asyncio.create_task(sb.close(), name=f"sandbox-close-{sb.id}")
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)
        await self._notify()
        self._wake.set()

    async def _notify(self) -> None:
        async with self._room:
            self._room.notify_all()

    @contextlib.asynccontextmanager
    async def session(self, key: str) -> AsyncIterator[Sandbox]:
        sb = await self.acquire(key)
        try:
            yield sb
        finally:
            await self.release(key)

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._refill_task is not None:
            # Let a refill in flight finish: a container being created when cancelled would be orphaned.
            try:
                await asyncio.wait_for(asyncio.shield(self._refill_task), 60)
            except (TimeoutError, asyncio.CancelledError):
                self._refill_task.cancel()
        sbs = [w.sandbox for w in self._warm] + [s for s in self.sessions.values() if s is not _PLACEHOLDER]
        self._warm.clear()
        self.sessions.clear()
        await asyncio.gather(*(s.close() for s in sbs), *self._closing, return_exceptions=True)


class _Placeholder:
    id = "pending"
    backend = "pending"


_PLACEHOLDER: Sandbox = _Placeholder()  # type: ignore[assignment]

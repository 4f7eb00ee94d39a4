"""Carrying out migrations: Heddle's transmission scheduler and the target's prefix warm-up.

Moves wait here until their endpoints are free; each batch takes the longest trajectories first and never
uses a worker twice (``schedule_transfers``). A move is applied (the trajectory's next step goes to the
target) as it starts, and the target loads the prefix while the trajectory's tool call runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from loom.policies.migration import Move, schedule_transfers
from loom.protocol import WarmDone, WarmPrefix, subjects
from loom.runtime.bus import request
from loom.runtime.service import Runtime

log = logging.getLogger(__name__)


class Transfers:
    def __init__(self, rt: Runtime, apply: Callable[[Move], Awaitable[bool]]) -> None:
        """``apply`` re-places the trajectory on the move's target; False drops the move."""
        self.rt = rt
        self.apply = apply
        self.pending: dict[str, tuple[Move, int]] = {}  # traj -> (move, context to warm)
        self.busy: set[str] = set()  # workers sending or receiving now
        self.tasks: set[asyncio.Task[None]] = set()
        self.m_moves = rt.metrics.counter(
            "migrations_total", "Trajectories migrated after a prediction update"
        )
        self.m_warm = rt.metrics.histogram("warm_seconds", "Time to warm a migration target's prefix (wall)")

    async def submit(self, move: Move, context_len: int) -> None:
        self.pending[move.traj] = (move, context_len)
        await self._start()

    def forget(self, traj: str) -> None:
        self.pending.pop(traj, None)

    def forget_job(self, job_id: str) -> None:
        for key in [k for k in self.pending if k.startswith(job_id + ".")]:
            del self.pending[key]

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _start(self) -> None:
        for mv in schedule_transfers([m for m, _ in self.pending.values()], self.busy):
            _, context = self.pending.pop(mv.traj)
            if not await self.apply(mv):
                continue
            self.m_moves.inc()
            self.busy.update((mv.src, mv.dst))
            t = asyncio.create_task(self._warm(mv, context))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _warm(self, mv: Move, context: int) -> None:
        t0 = time.time()
        job_id, traj_id = mv.traj.split(".", 1)
        try:
            if context > 0:
                warm = WarmPrefix(job_id, traj_id, context, source=mv.src)
                await request(self.rt.nc, subjects.worker_warm(mv.dst), warm, WarmDone, timeout_s=120)
        except Exception as e:
            log.warning("warming %s on %s failed: %s", mv.traj, mv.dst, e)
        finally:
            self.m_warm.observe(time.time() - t0)
            self.busy.difference_update((mv.src, mv.dst))
            if self.pending:
                await self._start()

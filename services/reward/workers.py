"""Reward worker processes: started from a fork server that has the reward code imported, stopped when idle,
killed when stuck, and accounted (cold starts, worker-seconds, busy seconds)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from services.reward import worker as worker_main
from services.reward.settings import RewardSettings

log = logging.getLogger(__name__)

_CTX = multiprocessing.get_context("forkserver")


@dataclass
class Worker:
    id: str
    proc: BaseProcess
    spawned_at: float
    ready_at: float | None = None
    inflight: int = 0
    idle_since: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    retiring: bool = False
    retired_at: float | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ready(self) -> bool:
        return self.ready_at is not None and not self.retiring and not self.exited.is_set()


class WorkerPool:
    def __init__(self, settings: RewardSettings, on_change: Callable[[], None]) -> None:
        self.settings = settings
        self.on_change = on_change
        self.workers: dict[str, Worker] = {}
        # The most recent cold starts (their mean is the keep-alive), and how many there have been.
        self.cold_starts: deque[float] = deque(maxlen=50)
        self.n_cold_starts = 0
        self.killed = 0
        self.peak = 0
        self._seq = itertools.count()
        self._prefix = f"{settings.instance}-{os.getpid()}".replace(".", "-")
        # Seconds of workers that have exited: alive (spawn to exit) and busy (as they last reported).
        self._dead_alive_s = 0.0
        self._dead_busy_s = 0.0
        self._json = settings.model_dump_json()

    @staticmethod
    def prepare() -> None:
        """Start the fork server with the reward code imported (once, about a second; blocking)."""
        multiprocessing.forkserver.set_forkserver_preload(["services.reward.preload"])
        multiprocessing.forkserver.ensure_running()

    def spawn(self) -> Worker:
        wid = f"{self._prefix}-{next(self._seq)}"
        proc = _CTX.Process(
            target=worker_main.main, args=(wid, self._json, os.getpid()), name=f"reward-{wid}", daemon=True
        )
        proc.start()
        w = Worker(wid, proc, time.monotonic())
        self.workers[wid] = w
        self.peak = max(self.peak, len(self.live()))
        asyncio.get_running_loop().add_reader(proc.sentinel, self._exited, w)
        return w

    def mark_ready(self, wid: str) -> float | None:
        """Its cold start in seconds, or None for a worker that is gone or was ready already."""
        w = self.workers.get(wid)
        if w is None or w.ready_at is not None:
            return None
        w.ready_at = w.idle_since = time.monotonic()
        self.cold_starts.append(w.ready_at - w.spawned_at)
        self.n_cold_starts += 1
        return w.ready_at - w.spawned_at

    def _exited(self, w: Worker) -> None:
        asyncio.get_running_loop().remove_reader(w.proc.sentinel)
        w.proc.join(0)
        now = time.monotonic()
        self._dead_alive_s += now - w.spawned_at
        self._dead_busy_s += w.busy_s
        self.workers.pop(w.id, None)
        w.exited.set()
        log.debug(
            "worker %s: lived %.3fs, cold %.3fs, busy %.3fs, exit lag %.3fs",
            w.id,
            now - w.spawned_at,
            (w.ready_at or now) - w.spawned_at,
            w.busy_s,
            now - (w.retired_at or now),
        )
        if not w.retiring:
            log.warning("reward worker %s (pid %s) died with code %s", w.id, w.proc.pid, w.proc.exitcode)
        self.on_change()

    def retire(self, w: Worker) -> None:
        """Stop taking work on ``w`` and let it exit (it finishes what it holds first)."""
        self._stop(w, signal.SIGTERM)

    def kill(self, w: Worker) -> None:
        self.killed += 1
        self._stop(w, signal.SIGKILL)

    def _stop(self, w: Worker, sig: signal.Signals) -> None:
        w.retiring = True
        w.retired_at = w.retired_at or time.monotonic()
        if w.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, sig)

    def live(self) -> list[Worker]:
        """Workers that count against the pool size: started or starting, not on their way out."""
        return [w for w in self.workers.values() if not w.retiring]

    def ready(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.ready]

    def free_slots(self) -> int:
        return sum(max(0, self.settings.worker_slots - w.inflight) for w in self.ready())

    def least_loaded(self) -> Worker | None:
        cands = [w for w in self.ready() if w.inflight < self.settings.worker_slots]
        return min(cands, key=lambda w: (w.inflight, w.spawned_at)) if cands else None

    def cold_start_s(self) -> float:
        """Recent spawn-to-ready time (the keep-alive break-even); 0.1 s before any worker has started."""
        recent = list(self.cold_starts)[-20:]
        return sum(recent) / len(recent) if recent else 0.1

    def worker_seconds(self) -> float:
        now = time.monotonic()
        return self._dead_alive_s + sum(now - w.spawned_at for w in self.workers.values())

    def busy_seconds(self) -> float:
        return self._dead_busy_s + sum(w.busy_s for w in self.workers.values())

    async def close(self, wait_s: float = 10.0) -> None:
        """Retire every worker, and kill those still there after ``wait_s``."""
        for w in list(self.workers.values()):
            self.retire(w)
        if not await self._all_exited(wait_s):
            for w in list(self.workers.values()):
                self.kill(w)
            await self._all_exited(2.0)

    async def _all_exited(self, timeout_s: float) -> bool:
        waits = [asyncio.ensure_future(w.exited.wait()) for w in self.workers.values()]
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        for t in pending:
            t.cancel()
        return not pending

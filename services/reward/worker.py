"""A reward worker process: scores the requests the controller assigns it and stores their results.

Workers are forked from a server that has already imported the reward functions (math-verify, sympy, the
tokenizer), so a cold start costs a fork and a NATS connection, not seconds of imports. A worker stores a
result before it replies; the controller acknowledges the stream message only after the reply, so a worker
killed at any point leaves the request to be delivered again, and the result stream's idempotency (by job
and trajectory) keeps a second store from counting twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time

from nats.aio.msg import Msg

from loom import logs
from loom.protocol import (
    DecodeError,
    RewardAssign,
    RewardOutcome,
    RewardRequest,
    WorkerReady,
    decode,
    encode,
    subjects,
)
from loom.rewards.context import RewardContext, RewardError
from loom.rewards.registry import score
from loom.runtime import bus
from loom.sandbox.settings import OnDemandSandboxes
from services.reward.settings import RewardSettings
from services.reward.store import store

log = logging.getLogger(__name__)


class _Busy:
    """Seconds with at least one request in hand (the numerator of pool utilisation)."""

    def __init__(self) -> None:
        self.inflight = 0
        self.total = 0.0
        self._since = 0.0

    def enter(self) -> None:
        if self.inflight == 0:
            self._since = time.monotonic()
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.total += time.monotonic() - self._since

    def seconds(self) -> float:
        return self.total + (time.monotonic() - self._since if self.inflight else 0.0)


class Worker:
    def __init__(self, worker_id: str, settings: RewardSettings) -> None:
        self.id = worker_id
        self.settings = settings
        self.busy = _Busy()
        self.stopping = asyncio.Event()
        self.sandboxes = OnDemandSandboxes(settings, f"reward-{worker_id}")
        self._tasks: set[asyncio.Task[None]] = set()

    async def run(self, watch_pid: int) -> None:
        self.nc = await bus.connect(
            self.settings.nats_url,
            f"loom-reward-worker-{self.id}",
            credentials=self.settings.nats_credentials(),
        )
        self.js = self.nc.jetstream(timeout=10)
        # Through an election (a nats-server died): a worker started meanwhile exited here, its slot lost.
        self.kv_traj = await bus.open_kv(self.js, subjects.KV_TRAJ)
        self.ctx = RewardContext(self.sandboxes.get, self.nc)
        await self.nc.subscribe(subjects.reward_worker(self.id), cb=self._on_assign)
        await self.nc.publish(subjects.REWARD_READY, encode(WorkerReady(self.id)))
        await self.nc.flush()
        try:
            while not self.stopping.is_set():
                # The controller's death (or its fork server's) leaves this worker an orphan: go.
                if not _alive(watch_pid):
                    log.warning("reward worker %s: controller %d is gone; exiting", self.id, watch_pid)
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 0.5)
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.settings.deadline_s)
        finally:
            await self.sandboxes.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5)

    async def _on_assign(self, msg: Msg) -> None:
        t = asyncio.create_task(self._handle(msg))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _handle(self, msg: Msg) -> None:
        self.busy.enter()
        try:
            out = await self._score(msg.data)
        finally:
            self.busy.leave()
        out.busy_s = self.busy.seconds()
        if msg.reply:
            await self.nc.publish(msg.reply, encode(out))

    async def _score(self, data: bytes) -> RewardOutcome:
        try:
            assign = decode(data, RewardAssign)
            req = decode(assign.data, RewardRequest)
        except DecodeError as e:
            return RewardOutcome(False, error=f"bad assignment: {e}", retryable=False)
        try:
            async with asyncio.timeout(assign.deadline_s):
                reward = await score(req, self.ctx)
                first = await store(self.js, self.kv_traj, self.nc, req.trajectory, reward)
            return RewardOutcome(True, duplicate=not first)
        except RewardError as e:
            return RewardOutcome(False, error=str(e), retryable=False)
        except TimeoutError:
            return RewardOutcome(False, error=f"deadline of {assign.deadline_s:g}s passed")
        except Exception as e:
            log.warning("scoring %s failed: %s", req.trajectory.traj_id, e)
            return RewardOutcome(False, error=f"{type(e).__name__}: {e}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(worker_id: str, settings_json: str, watch_pid: int) -> None:
    """Process entry point (forked by the controller's fork server)."""
    settings = RewardSettings.model_validate_json(settings_json)
    logs.configure(f"reward-worker-{worker_id}", settings.log_level)
    worker = Worker(worker_id, settings)

    async def _main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stopping.set)
        await worker.run(watch_pid)

    asyncio.run(_main())
    # Skip the interpreter's teardown (sympy and friends take a while to unload): a retired worker's
    # seconds count until it is gone, and everything it holds is already closed.
    logging.shutdown()
    os._exit(0)

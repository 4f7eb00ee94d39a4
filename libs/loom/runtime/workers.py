"""The worker registry (KV ``loom_workers``): rollout workers heartbeat their ``WorkerInfo`` into it.

Its keys are listed with ``bus.kv_keys``, never nats-py's ``KeyValue.keys()``, which while workers
heartbeat returned no keys, or some, about one time in 18 (256 workers): a router polling it dropped its
whole fleet in bursts. ``WorkerRegistry`` follows a watch instead and confirms a stale entry by a direct read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue

from loom.protocol import DecodeError, WorkerInfo, decode, subjects
from loom.runtime.bus import JS_ELECTING, kv_keys, through_failover

log = logging.getLogger(__name__)

# A bucket's stream and subjects, as NATS names them (ADR-8).
STREAM = f"KV_{subjects.KV_WORKERS}"
PREFIX = f"$KV.{subjects.KV_WORKERS}."

# A worker is live while its last heartbeat is younger than this (wall seconds).
LIVENESS_S = 6.0
# A fleet's weight update includes every worker heard from within this window: a worker whose heartbeats are
# late (its host busy loading weights and training on the same cores) but still serving must move with the
# fleet, or it would keep the old weights; one that is really gone fails the pause, and the update with it.
FLEET_MEMBER_S = 30.0
# A registry entry this old is dropped from a watcher's view (the bucket's keys live 15 s).
FORGET_S = 120.0


def is_live(info: WorkerInfo, now: float | None = None, within_s: float = LIVENESS_S) -> bool:
    return ((now if now is not None else time.time()) - info.heartbeat_at) < within_s


def _info(data: bytes, headers: dict[str, str] | None) -> WorkerInfo | None:
    if not data or (headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE):
        return None
    try:
        return decode(data, WorkerInfo)
    except DecodeError:
        return None


async def _read(js: JetStreamContext, subject: str) -> WorkerInfo | None:
    try:
        msg = await js.get_last_msg(STREAM, subject)
    except NotFoundError:
        return None
    return _info(msg.data or b"", msg.headers)


async def _read_all(js: JetStreamContext) -> dict[str, WorkerInfo]:
    """Every entry in the bucket, by key."""
    keys = await kv_keys(js, subjects.KV_WORKERS)
    found = await asyncio.gather(*(_read(js, PREFIX + k) for k in keys))
    return {k: w for k, w in zip(keys, found, strict=True) if w is not None}


def context_limit(workers: Iterable[WorkerInfo], model: str) -> int | None:
    """The longest context every given worker serving ``model`` takes; None when none of them bounds it."""
    limits = [w.max_context_tokens for w in workers if w.model == model and w.max_context_tokens]
    return min(limits) if limits else None


class ContextLimits:
    """The fleet's context limit per model (``context_limit``), read from the workers' bucket at most every
    ``ttl_s``: a trajectory loop asks before every call. It counts every worker heard from within
    ``FLEET_MEMBER_S``: heartbeats stall while the bucket's stream elects a leader, and a limit that vanished
    with them would let calls past it."""

    def __init__(self, js: JetStreamContext, ttl_s: float = 5.0) -> None:
        self.js = js
        self.ttl_s = ttl_s
        self._workers: list[WorkerInfo] = []
        self._read_at = -math.inf
        self._lock = asyncio.Lock()

    async def of(self, model: str) -> int | None:
        async with self._lock:
            if time.monotonic() - self._read_at > self.ttl_s:
                if self._read_at == -math.inf:  # nothing read yet: wait out an election
                    self._workers = list((await through_failover(self._read)).values())
                else:
                    # The bucket's stream electing a leader (a nats-server died) failed a trajectory here once:
                    # a limit a few seconds old serves until the next read.
                    try:
                        self._workers = list((await self._read()).values())
                    except JS_ELECTING as e:
                        log.warning(
                            "context limits kept from %.0f s ago: %r", time.monotonic() - self._read_at, e
                        )
                self._read_at = time.monotonic()
        return context_limit(self._workers, model)

    async def _read(self) -> dict[str, WorkerInfo]:
        return await read_workers(self.js, within_s=FLEET_MEMBER_S)


async def read_workers(
    js: JetStreamContext, live_only: bool = True, within_s: float = LIVENESS_S
) -> dict[str, WorkerInfo]:
    """Every registered worker (live ones only, by default)."""
    now = time.time()
    return {
        w.worker_id: w for w in (await _read_all(js)).values() if not live_only or is_live(w, now, within_s)
    }


class WorkerRegistry:
    """The live fleet, followed through a watch of the bucket (no request per worker per poll). A watch can
    stall for seconds (its consumer is recreated after a server fails over), so an entry that looks stale is
    read directly before its worker counts as gone."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, within_s: float = LIVENESS_S) -> None:
        self.js = js
        self.kv = kv
        self.within_s = within_s
        self.seen: dict[str, WorkerInfo] = {}
        self._gone: dict[str, float] = {}  # key -> the stale heartbeat a direct read confirmed
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None

    async def start(self) -> None:
        await self.stop()  # a start tried again (through an election) first drops the watch the last one made
        self._watcher = await self.kv.watchall()
        self._task = asyncio.create_task(self._follow(self._watcher))
        await asyncio.wait_for(self._ready.wait(), 30)
        # nats-py can say the initial entries are all in before any arrived: it checks the consumer's pending
        # count after the server has sent them all but before its callback took one (while 256 workers
        # heartbeat, one of the first two starts saw an empty fleet). The bucket read whole fills in the rest.
        for key, info in (await _read_all(self.js)).items():
            held = self.seen.get(key)
            if held is None or held.heartbeat_at < info.heartbeat_at:
                self.seen[key] = info

    async def stop(self) -> None:
        watcher, self._watcher = self._watcher, None
        task, self._task = self._task, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is None:  # the bucket's current entries are all in
                self._ready.set()
                continue
            if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                self.seen.pop(entry.key, None)
                continue
            try:
                self.seen[entry.key] = decode(entry.value, WorkerInfo)
            except DecodeError:
                log.warning("undecodable registry entry %s", entry.key)

    async def live(self) -> dict[str, WorkerInfo]:
        now = time.time()
        out: dict[str, WorkerInfo] = {}
        for key, info in list(self.seen.items()):
            if now - info.heartbeat_at > FORGET_S:  # its key expired long ago; expiry sends no watch event
                self.seen.pop(key, None)
                self._gone.pop(key, None)
                continue
            if not is_live(info, now, self.within_s) and self._gone.get(key) != info.heartbeat_at:
                fresh = await _read(self.js, PREFIX + key)
                if fresh is None:
                    self.seen.pop(key, None)
                    continue
                if fresh.heartbeat_at >= info.heartbeat_at:
                    info = self.seen[key] = fresh
                if not is_live(info, now, self.within_s):
                    self._gone[key] = info.heartbeat_at
            if is_live(info, now, self.within_s):
                out[info.worker_id] = info
                self._gone.pop(key, None)
        return out

"""Reading the worker registry while a fleet heartbeats into it: nothing missed, nothing dropped."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from loom.protocol import WorkerInfo, encode, subjects
from loom.runtime.bus import kv_keys
from loom.runtime.workers import WorkerRegistry, read_workers

FLEET = 256
STARTS = 20
# The stalled-watch test's liveness window: well above a heartbeat round of the fleet (256 puts), which took
# over a second on a loaded two-core CI host with a 1 s window, so that fresh workers read as stale.
WINDOW_S = 3.0


def _info(w: str, beat: float) -> bytes:
    return encode(WorkerInfo(w, "m", "sim", "H100", 1, 8, 1000, 0.0, beat))


@pytest.fixture
async def heartbeats(nc: NATS) -> AsyncIterator[tuple[KeyValue, set[str]]]:
    """A fleet heartbeating as fast as it can; workers named in the returned set stop beating."""
    kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
    silent: set[str] = set()
    stop = asyncio.Event()

    async def beat() -> None:
        while not stop.is_set():
            now = time.time()
            await asyncio.gather(
                *(kv.put(f"w{i}", _info(f"w{i}", now)) for i in range(FLEET) if f"w{i}" not in silent)
            )
            await asyncio.sleep(0.02)

    task = asyncio.create_task(beat())
    await asyncio.sleep(0.3)
    try:
        yield kv, silent
    finally:
        stop.set()
        await task


async def test_keys_and_workers_are_read_whole_while_the_fleet_heartbeats(
    nc: NATS, heartbeats: tuple[KeyValue, set[str]]
) -> None:
    """nats-py's KeyValue.keys() returned no keys, or some, in about one read in 18 here (it reads a watch
    until one message says nothing is pending); a router polling it dropped its whole fleet in bursts."""
    js = nc.jetstream()
    for _ in range(60):
        assert len(await kv_keys(js, subjects.KV_WORKERS)) == FLEET
    for _ in range(5):
        assert len(await read_workers(js)) == FLEET


async def test_the_watched_registry_follows_joins_and_deaths_and_survives_a_stalled_watch(
    nc: NATS, heartbeats: tuple[KeyValue, set[str]]
) -> None:
    kv, silent = heartbeats
    registry = WorkerRegistry(nc.jetstream(), kv, within_s=WINDOW_S)
    await registry.start()
    try:
        assert len(await registry.live()) == FLEET
        # A watch that stalls (its consumer being recreated on another server) drops nobody: an entry that
        # looks stale is read directly, and the heartbeat there is fresh.
        assert registry._watcher is not None
        await registry._watcher._sub.unsubscribe()
        await asyncio.sleep(WINDOW_S + 0.5)
        assert len(await registry.live()) == FLEET
        # A worker that stops beating is gone once its heartbeat is stale; a deleted one at once.
        silent.add("w7")
        await kv.delete("w8")
        silent.add("w8")
        await asyncio.sleep(WINDOW_S + 0.5)
        live = await registry.live()
        assert len(live) == FLEET - 2 and "w7" not in live and "w8" not in live
    finally:
        await registry.stop()


async def test_a_registry_started_while_the_fleet_heartbeats_sees_all_of_it_at_once(
    nc: NATS, heartbeats: tuple[KeyValue, set[str]]
) -> None:
    """nats-py's watch can say the bucket's entries are all in before any arrived (it checks the consumer's
    pending count once the server has sent them, before its callback took one); a router starting then saw
    no workers at all. CI caught it once in a few hundred starts."""
    kv, _ = heartbeats
    for _ in range(STARTS):
        registry = WorkerRegistry(nc.jetstream(), kv, within_s=1.0)
        await registry.start()
        try:
            assert len(await registry.live()) == FLEET
        finally:
            await registry.stop()


async def test_a_worker_that_joins_appears_through_the_watch(nc: NATS) -> None:
    kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
    registry = WorkerRegistry(nc.jetstream(), kv)
    await registry.start()
    try:
        assert await registry.live() == {}
        await kv.put("late", _info("late", time.time()))
        for _ in range(100):
            if "late" in await registry.live():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the joining worker never appeared")
    finally:
        await registry.stop()

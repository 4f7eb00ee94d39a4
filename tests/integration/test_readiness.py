"""A service is alive before it serves: a rollout worker answers its health while its engine starts and it joins
the fleet's weights, and says ``ready`` only once it takes requests. ``loom up``, the tests' ``Services.start``,
compose's healthcheck and Kubernetes' readiness probe wait for ``ready``; liveness asks only that it answers."""

from __future__ import annotations

import asyncio
import socket

import pytest
from nats.js.errors import KeyNotFoundError

from loom.engine.sim.engine import SimEngine
from loom.protocol import WorkerInfo, decode, subjects
from loom.runtime.healthcheck import check, gather
from loom.runtime.service import Runtime, serve
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from tests.integration.helpers import until


class _SlowJoin(RolloutWorker):
    """A worker whose join of the fleet's weights waits for ``joined`` (a fetch of a large checkpoint)."""

    joined: asyncio.Event

    async def _join_fleet(self, rt: Runtime) -> None:
        await self.joined.wait()


async def test_a_worker_is_alive_but_not_ready_until_it_serves(nats_url: str) -> None:
    host = socket.gethostname()
    settings = RolloutSettings(worker_id="w-slow", nats_url=nats_url, instance=f"{host}-w-slow")
    rt = Runtime("rollout", settings)
    holder: list[_SlowJoin] = []

    def build(rt: Runtime) -> _SlowJoin:
        w = _SlowJoin(rt, settings, SimEngine(clock=rt.clock))
        w.joined = asyncio.Event()
        holder.append(w)
        return w

    task = asyncio.create_task(serve(rt, build, signals=False))
    try:
        await until(lambda: bool(holder) and bool(rt._subs), within_s=20)
        (h,) = (await gather(nats_url, 1.0))["rollout"]
        assert h.ok and not h.ready
        # Alive (a liveness probe passes) but not serving (a readiness probe fails, saying why).
        assert await check(nats_url, host) is None
        assert await check(nats_url, host, ready=True) == f"rollout on {host} is alive but not serving yet"
        # Nothing routes to it yet: it is not in the workers' bucket.
        kv = await rt.js.key_value(subjects.KV_WORKERS)
        with pytest.raises(KeyNotFoundError):
            await kv.get("w-slow")

        holder[0].joined.set()
        await until(lambda: rt.ready, within_s=20)
        (h,) = (await gather(nats_url, 1.0))["rollout"]
        assert h.ok and h.ready
        assert await check(nats_url, host, ready=True) is None
        assert decode((await kv.get("w-slow")).value, WorkerInfo).worker_id == "w-slow"
    finally:
        if holder:
            holder[0].joined.set()  # a failure above must not leave run waiting on the join
        rt.stopping.set()
        await asyncio.wait_for(task, 20)

"""A service is alive before it serves: a rollout worker answers its health while its engine starts and it joins
the fleet's weights, and says ``ready`` only once it takes requests. ``loom up``, the tests' ``Services.start``,
compose's healthcheck and Kubernetes' readiness probe wait for ``ready``; liveness asks only that it answers.
Every service says ``ready`` at its own point: what it has done by then is recorded at that moment."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from nats.js.errors import KeyNotFoundError

from loom.engine.sim.engine import SimEngine
from loom.protocol import WorkerInfo, decode, subjects
from loom.runtime.healthcheck import check, gather
from loom.runtime.lifecycle import free_port
from loom.runtime.service import Runtime, serve
from loom.settings import LoomSettings
from services.envmgr.manager import EnvManager
from services.envmgr.settings import EnvmgrSettings
from services.reward.service import RewardService
from services.reward.settings import RewardSettings
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.router.router import Router
from services.router.settings import RouterSettings
from services.scheduler.__main__ import Scheduler
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, Services
from tests.integration.helpers import until

S = TypeVar("S")


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


async def _at_ready(
    services: Services,
    key: str,
    name: str,
    settings: LoomSettings,
    build: Callable[[Runtime], S],
    seen: Callable[[Runtime, S], Any],
) -> Any:
    """Start a service and return ``seen`` of it at the moment it first says it serves."""
    at: list[Any] = []

    def built(rt: Runtime) -> S:
        svc = build(rt)
        mark = rt.mark_ready

        def recorded() -> None:
            if not rt.ready:
                at.append(seen(rt, svc))
            mark()

        rt.mark_ready = recorded  # type: ignore[method-assign]
        return svc

    await services.start(key, name, settings, built)  # type: ignore[arg-type]
    return at[0]


def _subscribed(rt: Runtime) -> set[str]:
    return {sub.subject for sub in rt.nc._subs.values()}


async def test_every_service_says_ready_only_once_it_serves(services: Services) -> None:
    # The active router, once a generation request on its queue group reaches it; a standby, once it stands by.
    def router(key: str) -> Any:
        return _at_ready(
            services,
            key,
            "router",
            RouterSettings(instance=key),
            lambda rt: Router(rt, RouterSettings(instance=key)),
            # Whether it had asked for the lease (it stands by only once it finds another holding it).
            lambda rt, r: (hasattr(r, "lease"), r.active, subjects.GEN_REQUEST in _subscribed(rt)),
        )

    assert await router("router-a") == (True, True, True)
    assert await router("router-b") == (True, False, False)

    # The scheduler, once its REST port takes a connection (a standby's too: it forwards to the active one).
    settings = SchedulerSettings(port=free_port(), api_token=API_TOKEN)

    def listening(rt: Runtime, s: Scheduler) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", settings.port)) == 0

    assert await _at_ready(
        services, "scheduler", "scheduler", settings, lambda rt: Scheduler(rt, settings), listening
    )

    # The environment manager, once a job's cancel reaches it; reward, once a new request's notice does.
    env = EnvmgrSettings()
    assert await _at_ready(
        services, "envmgr", "envmgr", env, lambda rt: EnvManager(rt, env), lambda rt, m: _subscribed(rt)
    ) >= {subjects.CONTROL_CANCEL, subjects.CONTROL_GROUP_DONE, subjects.CONTROL_VERSION}
    reward = RewardSettings()
    assert subjects.REWARD_READY in await _at_ready(
        services,
        "reward",
        "reward",
        reward,
        lambda rt: RewardService(rt, reward),
        lambda rt, r: _subscribed(rt),
    )

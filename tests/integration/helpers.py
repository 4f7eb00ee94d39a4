"""Starting in-process services for integration tests (each over its own NATS connection)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from loom.engine.sim.engine import SimEngine
from loom.runtime.service import Runtime
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from services.router.router import Router
from services.router.settings import RouterSettings
from services.scheduler.__main__ import Scheduler
from services.scheduler.settings import SchedulerSettings
from tests.conftest import AUTH, Services

SPEED = 200.0


async def start_worker(
    services: Services,
    wid: str,
    max_running: int = 64,
    speed: float = SPEED,
    gpu: str = "h100",
    weight_link: str | None = None,
) -> RolloutWorker:
    holder: list[RolloutWorker] = []

    def build(rt: Runtime) -> RolloutWorker:
        engine = SimEngine(gpu=gpu, clock=rt.clock, max_running=max_running, weight_link=weight_link)
        w = RolloutWorker(rt, RolloutSettings(worker_id=wid), engine)
        holder.append(w)
        return w

    await services.start(wid, "rollout", RolloutSettings(worker_id=wid, speed=speed, keepalive_s=0.2), build)
    return holder[0]


async def start_router(services: Services, key: str = "router") -> Router:
    holder: list[Router] = []

    def build(rt: Runtime) -> Router:
        r = Router(rt, RouterSettings(registry_s=0.2))
        holder.append(r)
        return r

    await services.start(key, "router", RouterSettings(speed=SPEED, keepalive_s=0.2, registry_s=0.2), build)
    return holder[0]


async def start_scheduler_api(services: Services, settings: SchedulerSettings) -> str:
    """The scheduler in-process with its REST API; returns the API's URL once it answers."""
    await services.start("scheduler", "scheduler", settings, lambda rt: Scheduler(rt, settings))
    api = f"http://127.0.0.1:{settings.port}"
    await api_answers(api, within_s=5)
    return api


async def api_answers(api: str, within_s: float) -> None:
    """Until the scheduler at ``api`` answers an authenticated /healthz with 200 (AssertionError past ``within_s``)."""
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(headers=AUTH) as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get(f"{api}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"the scheduler's API at {api} did not come up")


async def until(cond: Callable[[], bool], within_s: float = 10.0, poll_s: float = 0.05) -> None:
    for _ in range(int(within_s / poll_s)):
        if cond():
            return
        await asyncio.sleep(poll_s)
    raise AssertionError("condition not reached")

"""Shared fixtures: a real nats-server on a free port per test, and in-process services over it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from loom.identity.allowlist import CODE_ALLOW_ENV
from loom.identity.auth import header
from loom.runtime import bus
from loom.runtime.natsserver import NatsServer
from loom.runtime.service import Runtime, Service, serve
from loom.settings import LoomSettings, default_shared_dir

SHARED = default_shared_dir()
# The only user code the tests' services may import (loom.identity.allowlist); subprocesses inherit it.
os.environ.setdefault(
    CODE_ALLOW_ENV, "tests.integration.reward_fns,tests.integration.user_envs,loom_guess,vf_calc,vf_missing"
)
# The admin token of schedulers the tests start in-process, and the header that presents it.
API_TOKEN = "test-admin-token-0123456789abcdef"
AUTH = header(API_TOKEN)


def need_shared(rel: str) -> Path:
    p = SHARED / rel
    if not p.exists():
        pytest.skip(f"{p} is missing: these tests read ../shared/data beside the project")
    return p


@pytest.fixture
async def nats_url(tmp_path: Path) -> AsyncIterator[str]:
    server = NatsServer(tmp_path / "nats", port=0)
    url = await server.start()
    try:
        yield url
    finally:
        await server.stop()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NATS]:
    conn = await nats.connect(nats_url)
    await bus.ensure_streams(conn.jetstream())
    try:
        yield conn
    finally:
        await conn.close()


class Services:
    """Start services in-process (each with its own Runtime and NATS connection); stop them on exit."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.running: dict[str, tuple[Runtime, asyncio.Task[None]]] = {}

    async def start(
        self, key: str, name: str, settings: LoomSettings, build: Callable[[Runtime], Service]
    ) -> Runtime:
        settings.nats_url = self.nats_url
        rt = Runtime(name, settings)
        task = asyncio.create_task(serve(rt, build, signals=False), name=f"svc-{key}")
        self.running[key] = (rt, task)
        # Until it serves (``Runtime.mark_ready``): a rollout worker's engine up and on the fleet's weights.
        deadline = time.monotonic() + 120
        while not rt.ready:
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{key} ({name}) did not serve within 120 s")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        return rt

    async def stop(self, key: str) -> None:
        rt, task = self.running.pop(key)
        rt.stopping.set()
        await asyncio.wait_for(task, 20)

    async def crash(self, key: str) -> None:
        """Die without draining, like kill -9: the task is cancelled and the connection dropped."""
        rt, task = self.running.pop(key)
        if rt._nc is not None:
            await rt._nc.close()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    async def close(self) -> None:
        for key in list(self.running):
            await self.stop(key)


@pytest.fixture
async def services(nats_url: str) -> AsyncIterator[Services]:
    s = Services(nats_url)
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture(scope="session")
def sandbox_image() -> str:
    """A Docker engine (started if none answers) with the default sandbox image (built if missing).

    Skips where no engine can run, unless LOOM_REQUIRE_DOCKER=1 (CI), where that is a failure.
    """
    from loom.sandbox import engine, images

    async def ready() -> str | None:
        if not await engine.ensure_engine():
            return None
        return await images.build(say=lambda s: print(s, flush=True))

    try:
        tag = asyncio.run(ready())
    except Exception as e:
        tag, why = None, str(e)
    else:
        why = "no Docker engine answers and none could be started"
    if tag is None:
        if os.environ.get("LOOM_REQUIRE_DOCKER") == "1":
            pytest.fail(f"Docker is required here: {why}")
        pytest.skip(f"needs Docker: {why}")
    return tag

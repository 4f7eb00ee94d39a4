"""What the SGLang and vLLM backend tests share: a simulated server in process, a client started on it, a rollout
worker behind a router driving it over NATS, and `loom sim-server` as a process."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from nats.aio.client import Client as NATS

from loom.engine.base import EngineRequest
from loom.engine.sim.engine import SimEngine
from loom.protocol import GenRequest, TrajMeta, WorkerInfo, decode, encode, subjects
from loom.runtime.bus import kv_key
from loom.runtime.genclient import GenClient
from services.rollout.__main__ import make_engine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from tests.conftest import Services
from tests.integration.helpers import start_router, until


class SimServer:
    """A simulated server's ``app`` over ``engine`` on a free port, uvicorn in process."""

    def __init__(self, engine: SimEngine, app: FastAPI) -> None:
        self.engine = engine
        self.app = app
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Any:
        await self.engine.start()
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        await until(lambda: self._server.started, poll_s=0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        await self.engine.close()
        self._sock.close()


def request(
    rid: str,
    n: int = 200,
    key: str | None = None,
    input_len: int = 1000,
    priority: float = 0,
    logprobs: bool = False,
    **kw: Any,
) -> EngineRequest:
    """A request of ``n`` tokens whatever the model would end on, its context keyed by ``key`` (else its rid)."""
    return EngineRequest(
        rid=rid,
        input_len=input_len,
        max_new_tokens=n,
        prefix_key=key or rid,
        ignore_eos=True,
        priority=priority,
        return_logprob=logprobs,
        **kw,
    )


@contextlib.asynccontextmanager
async def started(client: Any) -> AsyncIterator[Any]:
    """An engine client, started, closed after."""
    await client.start()
    try:
        yield client
    finally:
        await client.close()


async def served_through_the_router(
    nc: NATS, services: Services, server: SimServer, settings: RolloutSettings
) -> None:
    """A rollout worker of ``settings`` (its engine kind driving ``server``) behind a router: two steps of one
    trajectory are served, the second from the first's cached prefix, and the worker's registry entry names its
    engine kind and the server's capacity."""
    wid = settings.worker_id
    settings.keepalive_s = 0.2
    await services.start(
        wid, "rollout", settings, lambda rt: RolloutWorker(rt, settings, make_engine(rt, settings))
    )
    router = await start_router(services)
    await until(lambda: wid in router.workers, poll_s=0.01)
    kv = await nc.jetstream().key_value(subjects.KV_TRAJ)
    await kv.put(kv_key("job-1", "t0"), encode(TrajMeta("job-1", "t0", worker_id=wid)))
    client = GenClient(nc, lease_s=1.0)

    def step(i: int, input_len: int, max_new: int) -> GenRequest:
        return GenRequest(
            rid=f"s.{i}", job_id="job-1", traj_id="t0", step=i, input_len=input_len, max_new_tokens=max_new,
            ignore_eos=True,
        )  # fmt: skip

    first = await asyncio.wait_for(client.generate(step(0, 800, 120)), 20)
    assert (first.worker_id, first.output_len, first.finish_reason) == (wid, 120, "length")
    assert first.output_ids is not None and len(first.output_ids) == 120
    assert (await asyncio.wait_for(client.generate(step(1, 1000, 10)), 20)).cached_tokens == 920
    assert server.engine.load().generated_tokens == 130
    workers = await nc.jetstream().key_value(subjects.KV_WORKERS)
    info = decode((await workers.get(wid)).value or b"", WorkerInfo)
    assert (info.engine, info.kv_capacity_tokens) == (settings.engine, server.engine.info.kv_capacity_tokens)
    await services.stop(wid)
    await services.stop("router")


@contextlib.asynccontextmanager
async def sim_server_process(*args: str) -> AsyncIterator[tuple[str, str]]:
    """`loom sim-server ARGS --port 0` as a process: its URL and the line that announced it; it must stop cleanly
    on SIGTERM (exit 0) once the block is done."""
    code = (
        "import argparse, sys; from loom_cli.simserver import register; p = argparse.ArgumentParser(); "
        "register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.run(a))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, "sim-server", *args, "--port", "0", stderr=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), 20)).decode()
        url = re.search(r"http://\S+", line)
        assert url, line
        yield url.group(0), line
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

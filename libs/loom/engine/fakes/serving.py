"""Serving a simulated engine behind a server's HTTP API (``sglang_server``, ``vllm_server``): uvicorn on a
socket of its own, stopped by SIGTERM or SIGINT, the engine closed after it; and a request run for a client that
may go away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI, Request

from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.sim.engine import SimEngine

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # serve_engine() owns SIGTERM/SIGINT: they stop uvicorn, then the engine is closed.
        yield


async def serve_engine(engine: SimEngine, app: FastAPI, host: str, port: int, api: str, speed: float) -> None:
    """Run ``app`` over ``engine`` until SIGTERM or SIGINT; port 0 picks a free port. ``api`` names the
    server whose API it is and ``speed`` the engine clock's, for the log."""
    sock = socket.create_server((host, port))
    server = _Server(uvicorn.Config(app, log_level="warning"))
    loop = asyncio.get_running_loop()
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, setattr, server, "should_exit", True)
        await engine.start()
        bound = sock.getsockname()
        info = engine.info
        where = f"http://{bound[0]}:{bound[1]}"
        log.info("%s on %d x %s (time x%g), %s API at %s", info.model, info.tp, info.gpu, speed, api, where)
        await server.serve(sockets=[sock])
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await engine.close()
        sock.close()


def is_dir(path: str) -> bool:
    """Whether a checkpoint path names a directory here (``~`` expanded), as both servers check a load."""
    return os.path.isdir(os.path.expanduser(path))


async def generate_for(
    engine: SimEngine, req: EngineRequest, request: Request, poll_s: float, prepare_s: float = 0.0
) -> EngineOutput:
    """``req`` on the engine for the HTTP ``request``, registered with it after ``prepare_s`` seconds of
    preparation, and cancelled, in either phase, once its client goes away (checked every ``poll_s``), as both
    servers notice a vanished non-streaming client: the engine aborts a request on cancellation."""

    async def prepared() -> EngineOutput:
        await asyncio.sleep(prepare_s)
        return await engine.generate(req)

    run = asyncio.create_task(prepared(), name=f"sim-{req.rid}")
    try:
        while True:
            done, _ = await asyncio.wait({run}, timeout=poll_s)
            if done:
                return run.result()
            if await request.is_disconnected():
                break
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
    # Nobody reads this: the client is gone.
    return EngineOutput(rid=req.rid, output_len=0, finish_reason="abort")

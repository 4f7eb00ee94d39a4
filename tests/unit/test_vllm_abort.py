"""An abort ends its vLLM request early even where /abort_requests cannot find it: while vLLM still prepares the
request (the engine has not registered its id), and behind a proxy that names it by an X-Request-Id header of its
own. The client closes the connection once the abort's grace runs out, and vLLM cancels a request whose client
went away."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from loom.engine.clients.vllm import VLLMEngine, engine_rid
from loom.engine.fakes.vllm_server import Options
from tests.sim_servers import request, started
from tests.unit.test_vllm_client import MODEL, SimServer

LONG = 200_000  # tokens: the simulator would take many seconds to generate them


async def _aborted_early(client: VLLMEngine, server: SimServer, rid: str, after_s: float) -> None:
    t0 = time.monotonic()
    run = asyncio.create_task(client.generate(request(rid, n=LONG, input_len=64)))
    await asyncio.sleep(after_s)
    assert await client.abort(rid)
    out = await asyncio.wait_for(run, client.abort_grace_s + 5)
    assert out.finish_reason == "abort" and out.output_len < LONG
    assert time.monotonic() - t0 < client.abort_grace_s + 3
    # The server stopped generating it too.
    await asyncio.sleep(1.2)  # the simulator notices a closed connection within a second
    load = server.engine.load()
    assert load.running == load.waiting == 0


async def test_an_abort_while_vllm_prepares_the_request() -> None:
    async with (
        SimServer(options=Options(prepare_s=0.5)) as server,
        started(VLLMEngine(server.url, model=MODEL, poll_s=0.05)) as client,
    ):
        client.abort_grace_s = 1.0
        await _aborted_early(client, server, "prep.0", after_s=0.1)
        received = await server.received()
        # The abort reached vLLM while the request was being prepared, and found nothing there.
        assert received["aborted"] == [engine_rid("prep.0")]


@contextlib.asynccontextmanager
async def proxy(upstream: str) -> AsyncIterator[str]:
    """A reverse proxy that names every request with an X-Request-Id of its own, as proxies commonly do, and
    closes the upstream connection when its client goes away (nginx's default)."""
    session = aiohttp.ClientSession()

    async def forward(req: web.Request) -> web.StreamResponse:
        headers = {"X-Request-Id": uuid.uuid4().hex, "Content-Type": req.headers.get("Content-Type", "")}
        async with session.request(
            req.method, upstream + req.path_qs, data=await req.read(), headers=headers
        ) as r:
            body = await r.read()
            return web.Response(body=body, status=r.status, content_type=r.content_type)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        await session.close()


async def test_an_abort_through_a_proxy_that_renames_the_request() -> None:
    async with (
        SimServer() as server,
        proxy(server.url) as url,
        started(VLLMEngine(url, model=MODEL, poll_s=0.05)) as client,
    ):
        client.abort_grace_s = 1.0
        await _aborted_early(client, server, "px.0", after_s=0.5)
        received = await server.received()
        assert "px.0" not in received["requests"]  # vLLM knew it by the proxy's id
        assert received["aborted"] == [engine_rid("px.0")]  # so the abort named nothing it runs

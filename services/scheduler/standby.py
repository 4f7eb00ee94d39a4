"""A standby scheduler's REST edge: every request goes to the active scheduler, so the API answers on every
instance (a load balancer may send a client to any of them).

The active scheduler is the holder of the ``scheduler`` lease (``loom.runtime.lease``), whose record carries its
address. A standby forwards the request as it came (method, path, query, headers, body) and streams the
answer back as it comes (server-sent events included: the gateway's streamed completions, the dashboard's
updates). While no scheduler is active (at start, or in the takeover window: the active one died and its
lease has not yet lapsed) a request is held, up to about the lease's ttl, until one is; past that it is a 503
with ``Retry-After``, as is any other failure to reach the active one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# Hop-by-hop headers (RFC 9110 section 7.6.1) and those httpx sets from the body it sends or reads.
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "host"}
)
_READ = _HOP | {"content-length"}


class Role:
    """Whether this instance is the active scheduler, and where the active one serves (from its lease)."""

    def __init__(
        self, leader: Callable[[], Awaitable[str | None]], hold_s: float = 8.0, timeout_s: float = 900.0
    ) -> None:
        self.active = False
        self.hold_s = hold_s
        self._leader = leader
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def leader(self) -> str | None:
        return await self._leader()

    async def close(self) -> None:
        await self.client.aclose()


def add_standby(app: FastAPI, role: Role) -> None:
    """Forward every request to the active scheduler while ``role`` is not active. Added last, so that it runs
    first: the active scheduler authenticates and limits what is forwarded, as it does what comes to it."""
    app.add_middleware(Standby, role=role)


class Standby:
    """The forwarding, as a pure ASGI middleware (see ``api.Authenticate`` for why not Starlette's)."""

    def __init__(self, app: ASGIApp, role: Role) -> None:
        self.app, self.role = app, role

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        role = self.role
        if scope["type"] != "http" or role.active:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        body = await request.body()
        replay = _replayed(body, receive)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        # Held through a start or a takeover (no scheduler active yet, or the dead one's lease not yet lapsed)
        # rather than refused at once; 503 only past the hold.
        deadline = time.monotonic() + role.hold_s
        while True:
            if role.active:
                await self.app(scope, replay, send)
                return
            leader = await role.leader()
            if leader is not None:
                url = httpx.URL(leader.rstrip("/") + request.url.path, query=request.url.query.encode())
                try:
                    upstream = await role.client.send(
                        role.client.build_request(request.method, url, headers=headers, content=body),
                        stream=True,
                    )
                except httpx.ConnectError as e:
                    log.info("active scheduler at %s unreachable (%s); waiting for a takeover", leader, e)
                except httpx.HTTPError as e:
                    log.warning(
                        "could not forward %s %s to %s: %s", request.method, request.url.path, leader, e
                    )
                    await _unavailable(f"the active scheduler at {leader} did not answer: {e}")(
                        scope, replay, send
                    )
                    return
                else:
                    # Past this point the answer has begun: a body cut short upstream cuts this one short too.
                    await _relay(upstream)(scope, replay, send)
                    return
            if time.monotonic() >= deadline:
                await _unavailable("no scheduler is active (a standby is taking over)")(scope, replay, send)
                return
            await asyncio.sleep(0.1)


def _replayed(body: bytes, receive: Receive) -> Receive:
    """``receive`` with the body already read handed out again, once, as the app that runs next reads it."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _relay(upstream: httpx.Response) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    response = StreamingResponse(body(), status_code=upstream.status_code)
    response.raw_headers = [
        (k.encode("latin-1"), v.encode("latin-1"))
        for k, v in upstream.headers.multi_items()
        if k.lower() not in _READ
    ]
    return response


def _unavailable(why: str) -> JSONResponse:
    return JSONResponse(status_code=503, content={"detail": why}, headers={"Retry-After": "1"})

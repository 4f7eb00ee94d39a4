"""Client side of a generation call: request over NATS with a lease instead of a fixed deadline.

A long generation may legitimately take minutes, so the caller does not time out on the whole call;
it times out when it stops hearing from whoever holds the request (router keepalives while queued,
worker keepalives while running). Then it re-sends under the same ``rid``, which the worker dedupes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from nats.aio.client import Client as NATS

from loom.protocol import (
    AbortRequest,
    DecodeError,
    ErrorReply,
    GenAccepted,
    GenError,
    GenEvent,
    GenKeepalive,
    GenRequest,
    GenResult,
    decode_union,
    encode,
    subjects,
)

log = logging.getLogger(__name__)


class GenFailed(RuntimeError):
    """A generation that will not succeed; ``code`` is the engine's error code when it refused it."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class GenClient:
    def __init__(self, nc: NATS, lease_s: float = 3.0, give_up_s: float = 300.0) -> None:
        self.nc = nc
        self.lease_s = lease_s
        self.give_up_s = give_up_s
        self.resends = 0

    async def generate(self, req: GenRequest) -> GenResult:
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            return await self._call(req, inbox, sub)
        except asyncio.CancelledError:
            await self.nc.publish(subjects.GEN_ABORT, encode(AbortRequest(rid=req.rid)))
            raise
        finally:
            await sub.unsubscribe()

    async def _call(self, req: GenRequest, inbox: str, sub: object) -> GenResult:
        last_heard = time.monotonic()
        backoff = 0.1
        while True:
            await self.nc.publish(subjects.GEN_REQUEST, encode(req), reply=inbox)
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.lease_s)  # type: ignore[attr-defined]
                except TimeoutError:
                    break
                try:
                    ev = decode_union(msg.data, GenEvent | ErrorReply)
                except DecodeError as e:
                    log.warning("undecodable reply for %s: %s", req.rid, e)
                    continue
                last_heard = time.monotonic()
                if isinstance(ev, GenResult):
                    return ev
                if isinstance(ev, GenAccepted | GenKeepalive):
                    continue
                if isinstance(ev, ErrorReply) or not ev.retryable:
                    raise GenFailed(f"{req.rid}: {ev.code}: {ev.message}", ev.code)
                assert isinstance(ev, GenError)
                log.info("retryable error for %s: %s", req.rid, ev.message)
                break
            if time.monotonic() - last_heard > self.give_up_s:
                raise GenFailed(f"{req.rid}: no answer for {self.give_up_s:.0f} s")
            self.resends += 1
            req.attempt += 1
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 2.0)

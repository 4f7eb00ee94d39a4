"""The runtime every service runs in: NATS connection, health and metrics over NATS, SIGTERM drain.

A service is an object with ``async run(rt)`` that returns when ``rt.stopping`` is set, having finished
or handed back its in-flight work, and an optional ``health() -> dict``. Its health answers before ``run``
starts; it reports ``ready`` once it serves, which its ``run`` says by calling ``rt.mark_ready()`` at its own
point (a rollout worker once its engine is up and on the fleet's weights, the scheduler once its port listens).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from prometheus_client import start_http_server

from loom import __version__, logs
from loom.clock import Clock
from loom.metrics import Metrics
from loom.protocol import DeadLetter, DecodeError, ErrorReply, Health, decode, encode, subjects
from loom.runtime import bus
from loom.settings import LoomSettings

log = logging.getLogger(__name__)
T = TypeVar("T")


class Service(Protocol):
    async def run(self, rt: Runtime) -> None: ...

    def health(self) -> dict[str, Any]: ...


class Runtime:
    def __init__(self, name: str, settings: LoomSettings) -> None:
        self.name = name
        self.settings = settings
        self.instance = settings.instance
        self.clock = Clock(settings.speed, settings.clock_epoch)
        self.metrics = Metrics(name)
        self.stopping = asyncio.Event()
        self.started = time.monotonic()
        self._nc: NATS | None = None
        self._js: JetStreamContext | None = None
        self._subs: list[Subscription] = []
        self._handlers: list[Subscription] = []  # what ``subscribe`` took: the service's work, not its health
        self.ready = False

    def mark_ready(self) -> None:
        """The service serves: its health says so from now on (``loom up``, tests and readiness probes wait
        for it)."""
        if not self.ready:
            self.ready = True
            log.info("%s %s serves", self.name, self.instance)

    @property
    def nc(self) -> NATS:
        assert self._nc is not None, "runtime not connected"
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        assert self._js is not None, "runtime not connected"
        return self._js

    async def connect(self) -> None:
        self._nc = await bus.connect(
            self.settings.nats_url,
            f"loom-{self.name}-{self.instance}",
            credentials=self.settings.nats_credentials(),
        )
        self._js = self._nc.jetstream(timeout=10)
        await bus.ensure_streams(self._js)

    async def wait_stop(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` wall time; returns True as soon as the service is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
        return self.stopping.is_set()

    async def subscribe(
        self,
        subject: str,
        typ: type[T],
        handler: Callable[[T, Msg], Awaitable[Any]],
        queue: str = "",
    ) -> Subscription:
        """Subscribe with strict decoding. A malformed message gets an ``ErrorReply`` (when it has a reply
        subject), a metric and a dead letter; it never reaches the handler and never kills the service."""

        async def cb(msg: Msg) -> None:
            try:
                obj = decode(msg.data, typ)
            except DecodeError as e:
                await self.reject(msg, f"bad payload: {e}")
                return
            try:
                result = await handler(obj, msg)
            except bus.JS_FAILING_OVER as e:
                self.metrics.handler_errors.labels(subject).inc()
                log.warning(
                    "handler for %s: JetStream is failing over (%s); the caller asks again", msg.subject, e
                )
                if msg.reply:
                    await self.nc.publish(
                        msg.reply, encode(ErrorReply(bus.FAILOVER, f"{e}; nothing was done"))
                    )
                return
            except Exception as e:
                self.metrics.handler_errors.labels(subject).inc()
                log.exception("handler for %s failed", msg.subject)
                if msg.reply:
                    await self.nc.publish(msg.reply, encode(ErrorReply("internal", str(e))))
                return
            if result is not None and msg.reply:
                await self.nc.publish(msg.reply, encode(result))

        sub = await self.nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000)
        self._subs.append(sub)
        self._handlers.append(sub)
        return sub

    async def stop_handling(self) -> None:
        """Take no more messages on what ``subscribe`` took; health and metrics still answer. An instance that
        lost its lease stops acting now, not once its drain ends (after its API's graceful shutdown, seconds
        on which it went on completing jobs beside its successor)."""
        subs, self._handlers = self._handlers, []
        with contextlib.suppress(Exception):  # its connection is gone: nothing reaches it anyway
            for sub in subs:
                await sub.unsubscribe()
            # Until the server has read the unsubscriptions it routes requests here, where nobody reads them
            # (the caller would wait out its timeout, not be told at once that nobody answers).
            await self.nc.flush(timeout=2)

    async def reject(self, msg: Msg, reason: str) -> None:
        self.metrics.bad_messages.labels(msg.subject).inc()
        log.warning("rejected message on %s: %s", msg.subject, reason)
        if msg.reply:
            await self.nc.publish(msg.reply, encode(ErrorReply("bad_request", reason)))
        await self.dead_letter(msg.subject, reason, msg.data)

    async def dead_letter(self, subject: str, reason: str, payload: bytes) -> None:
        """Keep what could not be processed, with why, in the durable dead-letter stream."""
        try:
            await self.js.publish(
                subjects.dead_letter(self.name), encode(DeadLetter(self.name, subject, reason, payload))
            )
        except Exception as e:  # the message is lost only if JetStream itself is down
            log.error("could not store dead letter for %s: %s", subject, e)

    def health_payload(self, details: dict[str, Any]) -> Health:
        return Health(
            service=self.name,
            instance=self.instance,
            ok=True,
            uptime_s=time.monotonic() - self.started,
            version=__version__,
            pid=os.getpid(),
            details=details,
            ready=self.ready,
        )

    async def _serve_plumbing(self, service: Service) -> None:
        async def on_health(msg: Msg) -> None:
            details = service.health() if hasattr(service, "health") else {}
            await msg.respond(encode(self.health_payload(details)))

        async def on_metrics(msg: Msg) -> None:
            await msg.respond(self.metrics.exposition())

        # No queue group: every instance answers, so `loom status` sees them all.
        self._subs.append(await self.nc.subscribe(subjects.health(self.name), cb=on_health))
        self._subs.append(await self.nc.subscribe(subjects.metrics(self.name), cb=on_metrics))
        if self.settings.metrics_port is not None:
            start_http_server(self.settings.metrics_port, registry=self.metrics.registry)

    async def drain(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            if not self._nc.is_connected:
                # Nothing can be flushed to a server that is gone: stop now, not after the drain's timeout.
                await self._nc.close()
                return
            # Messages left in a callback-less subscription (a pull consumer's late status reply, say) have no
            # reader once the service is stopping; the drain would wait its whole timeout for them. JetStream
            # redelivers anything unacked, so dropping them loses nothing.
            for sub in list(self._nc._subs.values()):
                if sub._cb is None:
                    await sub.unsubscribe()
            try:
                await asyncio.wait_for(self._nc.drain(), timeout=10)
            except Exception as e:
                log.warning("drain failed: %s", e)
                await self._nc.close()


async def serve(rt: Runtime, build: Callable[[Runtime], Service], signals: bool = True) -> None:
    """Run one service until ``rt.stopping`` is set (by SIGTERM/SIGINT when ``signals``), then drain."""
    if signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, rt.stopping.set)
    await rt.connect()
    try:
        service = build(rt)
        await rt._serve_plumbing(service)
        log.info("%s %s up (pid %d, nats %s)", rt.name, rt.instance, os.getpid(), rt.settings.nats_url)
        await service.run(rt)
    finally:
        # However it ended (a lost lease, a crash), every loop that waits on the stop ends before the drain.
        rt.stopping.set()
        await rt.drain()
        log.info("%s %s stopped", rt.name, rt.instance)


def main(name: str, settings_cls: type[LoomSettings], build: Callable[[Runtime], Service]) -> None:
    """Entry point body shared by every ``services/<name>/__main__.py``."""
    settings = settings_cls()
    logs.configure(name, settings.log_level)
    asyncio.run(serve(Runtime(name, settings), build))

"""A durable pull consumer on a JetStream work queue that fetches only as much as it has room to run.

Each message runs as its own task; the handler acknowledges it when its output is safely stored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from loom.runtime.service import Runtime

log = logging.getLogger(__name__)


class WorkQueueConsumer:
    def __init__(
        self,
        rt: Runtime,
        *,
        stream: str,
        subject: str,
        durable: str,
        ack_wait_s: float,
        capacity: int,
        handler: Callable[[Msg], Coroutine[Any, Any, None]],
        batch: int = 64,
    ) -> None:
        self.rt = rt
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.ack_wait_s = ack_wait_s
        self.capacity = capacity
        self.handler = handler
        self.batch = batch
        self.tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()

    async def run(self) -> None:
        """Fetch and run messages until the service stops; in-flight tasks are left to ``finish``."""
        cfg = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=-1,
        )
        psub = await self.rt.js.pull_subscribe(
            self.subject, durable=self.durable, stream=self.stream, config=cfg
        )
        try:
            while not self.rt.stopping.is_set():
                free = self.capacity - len(self.tasks)
                if free <= 0:
                    self._room.clear()
                    stop = asyncio.ensure_future(self.rt.stopping.wait())
                    room = asyncio.ensure_future(self._room.wait())
                    await asyncio.wait({stop, room}, return_when=asyncio.FIRST_COMPLETED)
                    stop.cancel()
                    room.cancel()
                    continue
                try:
                    msgs = await psub.fetch(min(free, self.batch), timeout=1.0)
                except TimeoutError:
                    continue
                except Exception as e:
                    log.warning("fetch from %s failed: %s", self.stream, e)
                    await self.rt.wait_stop(0.5)
                    continue
                for m in msgs:
                    t = asyncio.create_task(self.handler(m))
                    self.tasks.add(t)
                    t.add_done_callback(self._done)
        finally:
            # A pull subscription never drains (fetch leaves status messages queued): drop it before drain.
            await psub.unsubscribe()

    def _done(self, t: asyncio.Task[None]) -> None:
        self.tasks.discard(t)
        self._room.set()
        if not t.cancelled() and t.exception() is not None:
            log.error("work handler failed", exc_info=t.exception())

    async def finish(self, wait_s: float) -> None:
        """Let in-flight work end for up to ``wait_s``, then cancel what is left (its handler naks)."""
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=wait_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

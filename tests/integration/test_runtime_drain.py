"""A stopping service drains in moments, whatever its pull consumers left unread; one that must stop acting
(its lease lost) takes no more work at once, and still answers its health."""

from __future__ import annotations

import time
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from loom.protocol import Health, StreamRef, decode, subjects
from loom.runtime import bus
from loom.runtime.service import Runtime
from loom.settings import LoomSettings


async def test_drain_does_not_wait_on_messages_nobody_will_read(nats_url: str) -> None:
    """A message left in a callback-less subscription (a pull consumer's late reply) kept every stopping
    scheduler in the drain for its whole 10 s timeout; five stream tests lost 50 s of CI to it."""
    rt = Runtime("scheduler", LoomSettings(nats_url=nats_url))
    await rt.connect()
    sub = await rt.nc.subscribe("loom.test.unread")
    await rt.nc.publish("loom.test.unread", b"left behind")
    await rt.nc.flush()
    for _ in range(50):
        if sub.pending_msgs:
            break
        await rt.nc.flush()
    assert sub.pending_msgs == 1
    t0 = time.monotonic()
    await rt.drain()
    assert rt.nc.is_closed and time.monotonic() - t0 < 2


async def test_a_service_that_stops_handling_takes_no_more_work_and_answers_its_health(nats_url: str) -> None:
    rt = Runtime("scheduler", LoomSettings(nats_url=nats_url))
    await rt.connect()

    class Service:
        async def run(self, rt: Runtime) -> None: ...

        def health(self) -> dict[str, Any]:
            return {"role": "standby"}

    handled: list[str] = []

    async def echo(ref: StreamRef, _msg: Msg) -> StreamRef:
        handled.append(ref.stream_id)
        return ref

    await rt._serve_plumbing(Service())
    await rt.subscribe("loom.test.work", StreamRef, echo)
    nc = await bus.connect(nats_url, "client")
    try:
        assert (await bus.request(nc, "loom.test.work", StreamRef("a"), StreamRef)).stream_id == "a"
        await rt.stop_handling()
        # Told at once that nobody answers, as a rule; on a loaded host the flush of the unsubscription may
        # outlast its 2 s and the request time out instead. Either way the handler never sees it.
        with pytest.raises((NoRespondersError, NatsTimeoutError)):
            await bus.request(nc, "loom.test.work", StreamRef("b"), StreamRef, timeout_s=2)
        assert handled == ["a"]
        health = decode((await nc.request(subjects.health("scheduler"), b"", timeout=2)).data, Health)
        assert health.details == {"role": "standby"}
    finally:
        await nc.close()
        await rt.drain()

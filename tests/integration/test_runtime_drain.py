"""A stopping service drains in moments, whatever its pull consumers left unread."""

from __future__ import annotations

import time

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

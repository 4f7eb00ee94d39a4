"""A trainer's requests wait out a scheduler takeover: from the active scheduler's death until its successor
has reloaded, no one answers the stream subjects, and a reload reads through the streams' elections."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loom.protocol import DatasetRef, Stream, StreamSpec, encode, subjects
from loom.trainer.client import StreamClient


async def test_a_trainer_waits_out_a_successor_whose_reload_outlasts_two_ttls(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_LEASE_TTL_S", "1")
    spec = StreamSpec(dataset=DatasetRef(name="swe-replay", limit=2), group_size=2, epochs=1)
    record = Stream("str-1", spec, "running", time.time(), time.time() + 60)

    async def answer(msg: Msg) -> None:
        await msg.respond(encode(record))

    async def successor() -> None:
        # It serves 6 s after the trainer first asks: past the 2 * ttl + 2 = 4 s (and the request's own 5 s)
        # the trainer used to wait, within a reload through an election.
        await asyncio.sleep(6.0)
        await nc.subscribe(subjects.STREAM_GET, cb=answer)

    asked = time.monotonic()
    serving = asyncio.create_task(successor())
    stream = await StreamClient.attach(nc, "str-1")
    assert stream.id == "str-1" and time.monotonic() - asked >= 6.0
    await stream.close(cancel=False)
    await serving

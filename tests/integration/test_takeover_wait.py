"""Every client of the scheduler over NATS waits out its takeover (``loom.runtime.leader``): from the active
scheduler's death until its successor has reloaded, no one answers its subjects, and a reload reads through the
streams' elections."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loom.protocol import DatasetRef, ErrorReply, PhaseAck, Stream, StreamSpec, encode, subjects
from loom.trainer.client import StreamClient
from loom.trainer.phases import PhaseClient, PhaseError


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


async def test_a_co_scheduled_job_waits_out_the_takeover_too(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RollMux's phase shim asked once and failed at the first no-responders: a scheduler's takeover ended a
    co-scheduled job's trainer."""
    monkeypatch.setenv("LOOM_LEASE_TTL_S", "1")
    asked: list[float] = []

    async def answer(msg: Msg) -> None:
        asked.append(time.monotonic())
        await msg.respond(encode(PhaseAck(granted=True)))

    async def successor() -> None:
        await asyncio.sleep(6.0)
        await nc.subscribe(subjects.PHASE_DONE, cb=answer)

    start = time.monotonic()
    serving = asyncio.create_task(successor())
    await PhaseClient(nc, "job-a").release("rollout")
    assert len(asked) == 1 and asked[0] - start >= 6.0
    await serving
    # An error the scheduler answers is still the job's error at once, not waited out.
    await nc.subscribe(subjects.PHASE_REQUEST, cb=_refuse)
    with pytest.raises(PhaseError, match="not_found: no such job"):
        await PhaseClient(nc, "ghost")._ask(subjects.PHASE_REQUEST, {"job": "ghost", "phase": "train"})


async def _refuse(msg: Msg) -> None:
    await msg.respond(encode(ErrorReply("not_found", "no such job")))

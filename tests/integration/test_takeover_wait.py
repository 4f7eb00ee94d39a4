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
from loom.runtime.leader import ask_active
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


async def test_a_read_the_dying_scheduler_held_is_asked_again_of_its_successor(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scheduler killed with -9 holding a trainer's request answers nothing, nor says so: the request timed
    out and the trainer's ``get_batch`` failed with ``TimeoutError`` mid-takeover (the HA test in CI). A read is
    asked again; a request that is not idempotent may have been done, so its timeout stays the caller's."""
    monkeypatch.setenv("LOOM_LEASE_TTL_S", "1")
    spec = StreamSpec(dataset=DatasetRef(name="swe-replay", limit=2), group_size=2, epochs=1)
    record = Stream("str-1", spec, "running", time.time(), time.time() + 60)
    held: list[Msg] = []
    got = asyncio.Event()

    async def hold(msg: Msg) -> None:
        held.append(msg)
        got.set()

    async def answer(msg: Msg) -> None:
        await msg.respond(encode(record))

    dying = await nc.subscribe(subjects.STREAM_GET, cb=hold)
    stream = StreamClient(nc, record)
    try:
        reading = asyncio.create_task(stream.refresh())
        await asyncio.wait_for(got.wait(), 5)
        await dying.unsubscribe()  # dead, the request unanswered
        await nc.subscribe(subjects.STREAM_GET, cb=answer)
        assert (await asyncio.wait_for(reading, 15)).id == "str-1"
        assert len(held) == 1

        await nc.subscribe(subjects.STREAM_CREATE, cb=hold)
        with pytest.raises(TimeoutError):
            await ask_active(nc, subjects.STREAM_CREATE, spec, Stream, timeout_s=0.5)
    finally:
        await stream.close(cancel=False)

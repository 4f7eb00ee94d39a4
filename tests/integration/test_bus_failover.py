"""The scheduler while JetStream elects leaders (a nats-server of a cluster died): over a real nats-server whose
streams are gone for a moment, as a failing-over cluster's are to a write.

- a write the stream's record or its work needs is done again until the stream is back, and a trainer's report
  of a batch taken lands (it once failed the trainer with "no response from stream");
- a report asked twice (its answer lost) counts its groups once;
- past ``bus.FAILOVER_S`` the service answers ``bus.FAILOVER`` (nothing was done) and the REST edge 503 with
  ``Retry-After``, never an internal error.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from nats.aio.client import Client as NATS

from loom.protocol import BatchTaken, DatasetRef, Stream, StreamRef, StreamSpec, decode, subjects
from loom.runtime import bus
from loom.trainer.client import StreamClient
from loom_cli.deploy import free_port
from tests.conftest import AUTH, Services, need_shared
from tests.integration.test_stream_loop import start_scheduler


def _spec(buffer_groups: int) -> StreamSpec:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    return StreamSpec(
        dataset=DatasetRef(name="swe-replay", offset=0, limit=8),
        group_size=2,
        max_turns=2,
        buffer_groups=buffer_groups,
    )


async def _gone_for(nc: NATS, seconds: float, *streams: str) -> asyncio.Task[None]:
    js = nc.jetstream(timeout=10)
    for s in streams:
        await js.delete_stream(s)

    async def back() -> None:
        await asyncio.sleep(seconds)
        await bus.ensure_streams(js)

    return asyncio.create_task(back())


async def test_a_batch_taken_mid_election_lands_and_its_refill_is_published(
    nc: NATS, services: Services
) -> None:
    await start_scheduler(services)
    async with await StreamClient.create(nc, _spec(buffer_groups=2)) as stream:
        assert sorted(stream.stream.open) == [0, 1]
        back = await _gone_for(nc, 1.5, f"KV_{subjects.KV_STREAMS}", subjects.STREAM_TRAJWORK)
        # Group 0 taken: its record is saved and group 2 started, both while their streams are gone.
        await stream._report(BatchTaken(stream.id, stream.version, groups=[0]))
        assert back.done()
        st = stream.stream
        assert st.state == "running" and st.delivered == 1 and sorted(st.open) == [1, 2], st
        kv = await nc.jetstream().key_value(subjects.KV_STREAMS)
        assert (
            decode((await kv.get(stream.id)).value or b"", Stream).delivered == 1
        )  # written once it was back
        work = await nc.jetstream().stream_info(subjects.STREAM_TRAJWORK)
        assert work.state.messages == 2  # group 2's two samples, published once the stream was back

        # The same report again (a trainer whose answer was lost asks again): group 0 counts once.
        await stream._report(BatchTaken(stream.id, stream.version, groups=[0]))
        assert stream.stream.delivered == 1 and sorted(stream.stream.open) == [1, 2]


async def test_past_the_election_the_service_says_failover_and_the_rest_edge_503(
    nc: NATS, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bus, "FAILOVER_S", 1.0)
    port = free_port()
    await start_scheduler(services, port=port)
    async with await StreamClient.create(nc, _spec(buffer_groups=1)) as stream:
        back = await _gone_for(nc, 60, f"KV_{subjects.KV_STREAMS}")
        try:
            with pytest.raises(bus.BusError) as e:
                await bus.request(nc, subjects.STREAM_LEASE, StreamRef(stream.id), Stream, timeout_s=10)
            assert e.value.code == bus.FAILOVER, e.value
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10
            ) as http:
                for _ in range(50):  # uvicorn comes up beside the service
                    with contextlib.suppress(httpx.TransportError):
                        if (await http.get("/healthz")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
                r = await http.post(f"/v1/streams/{stream.id}/lease")
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "failing over" in r.json()["detail"]
        finally:
            back.cancel()
            await bus.ensure_streams(nc.jetstream())


async def test_the_last_report_asked_again_answers_the_completed_stream(nc: NATS, services: Services) -> None:
    """The report that completes a finite stream, its answer lost and asked again, once failed the trainer with
    "gone: stream ... is completed" after it had taken every group."""
    await start_scheduler(services)
    async with await StreamClient.create(nc, _spec(buffer_groups=4)) as stream:
        last = BatchTaken(stream.id, stream.version, groups=[])
        while stream.stream.open:
            last = BatchTaken(stream.id, stream.version, groups=sorted(stream.stream.open))
            await stream._report(last)
        assert stream.stream.state == "completed" and stream.stream.delivered == 8, stream.stream
        await stream._report(last)
        assert stream.stream.state == "completed" and stream.stream.delivered == 8

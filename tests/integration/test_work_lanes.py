"""Work lanes on a real nats-server: GEM's trajectories reach only the managers that serve GEM's lane, the main
managers keep everything else, and a store from before lanes (one consumer taking all of ``trajwork.>``) is
narrowed so that a lane's consumer can be made beside it."""

from __future__ import annotations

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from loom.envs import registry
from loom.protocol import subjects
from services.envmgr.manager import DURABLE, durable, narrow_legacy_consumer


async def _take(nc: NATS, lane: str) -> list[str]:
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        subjects.traj_work_filter(lane),
        durable=durable(lane),
        stream=subjects.STREAM_TRAJWORK,
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, max_deliver=-1
        ),
    )
    try:
        msgs = await sub.fetch(10, timeout=1.0)
    except nats.errors.TimeoutError:
        msgs = []
    for m in msgs:
        await m.ack()
    await sub.unsubscribe()
    return sorted(m.data.decode() for m in msgs)


async def test_a_store_from_before_lanes_is_narrowed_and_lanes_take_their_own_work(nc: NATS) -> None:
    js = nc.jetstream()
    legacy = ConsumerConfig(
        durable_name=DURABLE,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=-1,
        max_ack_pending=-1,
        filter_subject=subjects.STREAM_TRAJWORK_SUBJECTS[0],
    )
    await js.add_consumer(subjects.STREAM_TRAJWORK, legacy)
    await js.publish(subjects.traj_work("job-old"), b"queued before the upgrade")
    await narrow_legacy_consumer(js)
    await narrow_legacy_consumer(js)  # idempotent: any manager may start first
    info = await js.consumer_info(subjects.STREAM_TRAJWORK, DURABLE)
    assert info.config.filter_subject == subjects.traj_work_filter(subjects.MAIN_LANE)
    assert info.config.ack_wait == 30.0
    for job in ("job-a", "job-b"):
        await js.publish(
            subjects.traj_work(job, registry.resolve("gem:game:GuessTheNumber-v0-easy").lane), job.encode()
        )
        await js.publish(subjects.traj_work(job, registry.resolve("math").lane), f"{job} main".encode())
    assert await _take(nc, "gem") == ["job-a", "job-b"]
    assert await _take(nc, subjects.MAIN_LANE) == ["job-a main", "job-b main", "queued before the upgrade"]
    # A job's lane work goes with one purge (a cancel's), the main lane's with another.
    await js.publish(subjects.traj_work("job-c", "gem"), b"x")
    await js.purge_stream(subjects.STREAM_TRAJWORK, subject=subjects.traj_work_lanes("job-c"))
    assert (await js.stream_info(subjects.STREAM_TRAJWORK)).state.messages == 0


async def test_narrowing_leaves_a_fresh_store_alone(nc: NATS) -> None:
    js = nc.jetstream()
    await narrow_legacy_consumer(js)
    with pytest.raises(NotFoundError):
        await js.consumer_info(subjects.STREAM_TRAJWORK, DURABLE)

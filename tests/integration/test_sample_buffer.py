"""A trainer's batch from the sample buffer (``loom.trainer.buffer``), over a real nats-server's JetStream."""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS

from loom.protocol import (
    BatchTaken,
    DatasetRef,
    SampleGroup,
    Stream,
    StreamSpec,
    Trajectory,
    encode,
    subjects,
)
from loom.runtime import bus
from loom.trainer.buffer import SampleBuffer


async def test_a_batch_holds_its_groups_in_the_order_the_stream_opened_them(nc: NATS) -> None:
    """Groups reach the buffer as they finish, which the engines' timings decide; the batch is the same batch
    (its minibatches and gradients) whichever finished first. They once came in the order they finished."""
    js = nc.jetstream(timeout=10)
    await bus.ensure_streams(js)
    spec = StreamSpec(dataset=DatasetRef(name="swe-replay", limit=4), group_size=1, epochs=1)
    record = Stream("str-o", spec, "running", time.time(), time.time() + 60)
    for g in (3, 0, 2, 1):  # finished out of order
        t = Trajectory(
            "str-o", f"t{g}", f"task{g}", g, 0, "replay", "completed", "done", [], 0.0, 1.0, reward=1.0
        )
        ack = await js.publish(subjects.results("str-o"), encode(t))
        group = SampleGroup("str-o", g, f"task{g}", 0, [t.traj_id], [ack.seq])
        await js.publish(subjects.samples("str-o"), encode(group))
    reports: list[BatchTaken] = []

    async def read() -> Stream:
        return record

    async def report(taken: BatchTaken) -> None:
        reports.append(taken)

    buffer = SampleBuffer(js, "str-o", read, report)
    try:
        batch = await buffer.take(4, timeout_s=10)
    finally:
        await buffer.close(delete=True)
    assert [g.group for g in batch.groups] == [0, 1, 2, 3]
    assert [t.task_id for t in batch.trajectories] == ["task0", "task1", "task2", "task3"]
    assert [r.groups for r in reports] == [[0, 1, 2, 3]]

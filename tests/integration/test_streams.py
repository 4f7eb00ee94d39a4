"""JetStream plumbing: idempotent setup, idempotent results, paging and header scans."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from loom import bus, results
from loom.protocol import Step, Trajectory


def _traj(job: str, i: int, status: str = "completed") -> Trajectory:
    steps = [Step(0, 100, 10 + i), Step(1, 200, 5)]
    return Trajectory(
        job, f"t{i:03d}", f"task{i % 2}", i, 0, "replay", status, "done", steps, 0.0, 1.0, reward=1.0
    )  # type: ignore[arg-type]


async def test_setup_is_idempotent(nc: NATS) -> None:
    js = nc.jetstream()
    await bus.ensure_streams(js)
    await bus.ensure_streams(js)
    assert (await js.stream_info("LOOM_RESULTS")).config.duplicate_window == 3600.0


async def test_results_are_stored_once_paged_and_scanned(nc: NATS) -> None:
    js = nc.jetstream()
    for i in range(25):
        assert await results.publish_result(js, _traj("job-a", i))
    assert not await results.publish_result(js, _traj("job-a", 3))  # redelivery: deduplicated
    await results.publish_result(js, _traj("job-b", 0, "failed"))
    assert await results.count_results(js, "job-a") == 25

    page1, cur = await results.page_results(js, "job-a", 0, 10)
    page2, cur2 = await results.page_results(js, "job-a", cur, 10)
    page3, _ = await results.page_results(js, "job-a", cur2, 10)
    ids = [t.traj_id for _, t in page1 + page2 + page3]
    assert ids == [f"t{i:03d}" for i in range(25)]
    assert len(page3) == 5

    heads = await results.scan_headers(js)
    assert len(heads) == 26
    a0 = next(h for h in heads if h.job_id == "job-a" and h.traj_id == "t000")
    assert (a0.task_id, a0.status, a0.output_tokens, a0.reward) == ("task0", "completed", 15, 1.0)
    assert [h.status for h in await results.scan_headers(js, "job-b")] == ["failed"]
    assert await results.scan_headers(js, "job-none") == []

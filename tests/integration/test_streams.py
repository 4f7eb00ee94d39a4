"""JetStream plumbing: idempotent setup, idempotent results, paging and header scans."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy

from loom.protocol import Step, Trajectory, encode, subjects
from loom.runtime import bus, results


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


async def test_every_stream_and_record_bucket_has_a_retention_limit(
    nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 9: nothing grows for ever. Work queues refuse new work at their limit rather than drop
    queued trajectories; the logs drop their oldest."""
    monkeypatch.setenv("LOOM_RETENTION_DAYS", "2")
    monkeypatch.setenv("LOOM_RESULTS_MAX_GB", "1")
    js = nc.jetstream()
    await bus.ensure_streams(js)
    for name in ("LOOM_RESULTS", subjects.STREAM_TRAJWORK, subjects.STREAM_REWARD, subjects.STREAM_SAMPLES):
        cfg = (await js.stream_info(name)).config
        assert cfg.max_age == 2 * 24 * 3600.0 and cfg.max_bytes and cfg.max_bytes > 0, name
    assert (await js.stream_info("LOOM_RESULTS")).config.max_bytes == 2**30
    assert (await js.stream_info(subjects.STREAM_TRAJWORK)).config.discard == DiscardPolicy.NEW
    for bucket in (subjects.KV_JOBS, subjects.KV_TRAJ, subjects.KV_GROUPS):
        assert (await (await js.key_value(bucket)).status()).ttl == 2 * 24 * 3600.0


async def test_results_are_stored_once_paged_and_scanned(nc: NATS) -> None:
    js = nc.jetstream()
    for i in range(25):
        assert await results.publish_result(js, _traj("job-a", i))
    assert not await results.publish_result(js, _traj("job-a", 3))  # redelivery: deduplicated
    await results.publish_result(js, _traj("job-b", 0, "failed"))
    assert await results.count_results(js, "job-a") == 25

    page1, cur, end1 = await results.page_results(js, "job-a", 0, 10)
    page2, cur2, _ = await results.page_results(js, "job-a", cur, 10)
    page3, _, end3 = await results.page_results(js, "job-a", cur2, 10)
    ids = [t.traj_id for _, t in page1 + page2 + page3]
    assert ids == [f"t{i:03d}" for i in range(25)]
    assert len(page3) == 5 and end3 and not end1

    heads = await results.scan_headers(js)
    assert len(heads) == 26
    a0 = next(h for h in heads if h.job_id == "job-a" and h.traj_id == "t000")
    assert (a0.task_id, a0.status, a0.output_tokens, a0.reward) == ("task0", "completed", 15, 1.0)
    assert [h.status for h in await results.scan_headers(js, "job-b")] == ["failed"]
    assert await results.scan_headers(js, "job-none") == []

    # Finding 7: an undecodable record (and one with unparsable headers) is skipped, reported and logged;
    # the results after it stay readable, paged and streamed alike.
    await js.publish(subjects.results("job-a"), b"\x00not a trajectory")
    await js.publish(
        subjects.results("job-a"), encode(_traj("job-a", 90)), headers={"Loom-Output-Tokens": "x"}
    )
    await results.publish_result(js, _traj("job-a", 99))
    bad: list[int] = []
    rest, _, end = await results.page_results(js, "job-a", cur2, 100, lambda seq, why: bad.append(seq))
    assert [t.traj_id for _, t in rest][-2:] == ["t090", "t099"] and end and len(bad) == 1
    streamed = [t.traj_id async for t in results.iter_results(js, "job-a", page=3)]
    assert len(streamed) == 27 and streamed[-1] == "t099"
    assert len(await results.scan_headers(js, "job-a")) == 26  # the two bad ones left out

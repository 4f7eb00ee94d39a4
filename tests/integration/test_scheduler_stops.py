"""A scheduler that can no longer act stops answering, rather than answer from what it last knew; and a result
read that fails partway fails the reader, rather than end as if the job had no more results.

Both were one CI failure of the HA test: the active scheduler lost its lease in a NATS election, its loops and
its API lived on with the bus connection closed (answering a job's state frozen at 11 of 12 and a result
stream of nothing, both as 200s), and its supervisor never restarted it because it never exited."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import msgspec
import nats
import pytest
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from loom.protocol import (
    Job,
    JobSpec,
    Step,
    Stream,
    StreamRef,
    TrajDone,
    Trajectory,
    decode,
    encode,
    subjects,
)
from loom.runtime import bus, results
from loom.runtime.lease import Holder, lease_bucket
from loom.runtime.service import Runtime
from loom_cli.client import LoomClient
from loom_cli.deploy import free_port
from services.scheduler.__main__ import Scheduler
from services.scheduler.jobs import JobManager, NotActing
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, AUTH, Services, need_shared
from tests.integration.helpers import api_answers

REPO = Path(__file__).resolve().parents[2]
JOB = {"dataset": {"name": "swe-replay", "limit": 2}, "group_size": 2}


async def test_a_scheduler_that_loses_its_lease_closes_its_api_and_exits(
    nats_url: str, tmp_path: Path
) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await bus.ensure_streams(js)
    port = free_port()
    env = {
        **os.environ,
        "LOOM_NATS_URL": nats_url,
        "LOOM_SCHEDULER_PORT": str(port),
        "LOOM_API_TOKEN": API_TOKEN,
        "LOOM_LEASE_TTL_S": "2",
        "PYTHONPATH": str(REPO),
    }
    log = (tmp_path / "scheduler.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.scheduler", cwd=REPO, env=env, stdout=log, stderr=log
    )
    try:
        api = f"http://127.0.0.1:{port}"
        await api_answers(api, within_s=30)
        async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
            # A rollout stream, so that its result reader runs too: it kept the old process alive.
            made = await http.post(f"{api}/v1/streams", json={**JOB, "buffer_groups": 1})
            assert made.status_code == 201, made.text
            ref = StreamRef(made.json()["id"])
            # Another instance takes the lease, as one does after an election outlasts the lease's ttl.
            kv = await lease_bucket(js)
            await kv.delete("scheduler")
            other = Holder("other", "http://127.0.0.1:1", "n", time.time())
            await kv.create("scheduler", msgspec.json.encode(other))
            lost = time.monotonic()
            # It stops acting at its next renewal (every ttl / 4), not once its API has shut down: the HA test's
            # logs showed a scheduler completing a job 4 s after its successor took over.
            while True:
                try:
                    await bus.request(nc, subjects.STREAM_GET, ref, Stream, timeout_s=2)
                except (NoRespondersError, NatsTimeoutError):  # unanswered: see test_runtime_drain
                    break
                assert time.monotonic() - lost < 10, "it answers on"
                await asyncio.sleep(0.05)
            stopped_acting = time.monotonic() - lost
            code = await asyncio.wait_for(proc.wait(), 20)
            exited = time.monotonic() - lost
        assert code == 3, code
        assert stopped_acting < 1.5 and exited < 12, (stopped_acting, exited)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()
        await nc.close()
    assert b"stops: lease scheduler was taken by other" in (tmp_path / "scheduler.log").read_bytes()


async def test_what_a_scheduler_had_pending_when_it_lost_its_lease_writes_nothing(nats_url: str) -> None:
    """Its progress saves (batched, a timer each) and launches went on until the process exited, seconds
    after its successor took over, and could overwrite a record the successor had advanced since."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    settings = SchedulerSettings(nats_url=nats_url, progress_save_s=0.5, instance="s")
    rt = Runtime("scheduler", settings)
    await rt.connect()
    try:
        await bus.ensure_streams(rt.js)
        jobs = JobManager(rt, settings)
        await jobs.start()
        job = await jobs.submit(msgspec.convert(JOB, JobSpec))

        async def stored() -> Job:
            return decode((await jobs.kv_jobs.get(job.id)).value, Job)

        async def done(traj: str) -> None:
            event = TrajDone(job.id, traj, "completed", 1.0, 10, 1)
            await rt.nc.publish(subjects.traj_done(job.id), encode(event))

        # Acting: a finished trajectory's count is saved once its batch's timer fires.
        await done("t0")
        for _ in range(100):
            if (await stored()).completed == 1:
                break
            await asyncio.sleep(0.05)
        assert (await stored()).completed == 1
        # The next one's save is pending when the lease goes.
        await done("t1")
        for _ in range(100):
            if job.id in jobs._saving:
                break
            await asyncio.sleep(0.01)
        assert job.id in jobs._saving
        jobs.stop_acting()
        await asyncio.sleep(1.0)
        assert (await stored()).completed == 1
        with pytest.raises(NotActing, match="lost its lease"):
            await jobs.cancel(job.id)
        assert (await stored()).state == "pending"
    finally:
        await rt.nc.close()


def _traj(job: str, i: int) -> Trajectory:
    return Trajectory(
        job, f"t{i}", "task", i, 0, "replay", "completed", "done", [Step(0, 100, 10)], 0.0, 1.0, reward=1.0
    )  # type: ignore[arg-type]


async def test_a_result_read_that_fails_partway_fails_the_reader(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    settings = SchedulerSettings(port=free_port(), api_token=API_TOKEN, instance="s")
    rt = await services.start("s", "scheduler", settings, lambda rt: Scheduler(rt, settings))
    api = f"http://127.0.0.1:{settings.port}"
    await api_answers(api, within_s=30)
    async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
        made = await http.post(f"{api}/v1/jobs", json=JOB)
        assert made.status_code == 201, made.text
        job = made.json()["id"]
        for i in range(3):
            await results.publish_result(rt.js, _traj(job, i))

        real = results.page_results
        calls, fail = 0, {2: ConnectionClosedError(), 3: ConnectionClosedError()}

        async def failing(*a: object, **k: object) -> object:
            nonlocal calls
            calls += 1
            if calls in fail:
                raise fail[calls]
            return await real(*a, **k)  # type: ignore[arg-type]

        monkeypatch.setattr(results, "page_results", failing)
        # NDJSON, a page of one at a time: the first line arrives, then the read fails (not a clean end).
        lines: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):
            params = {"format": "ndjson", "limit": 1}
            async with http.stream("GET", f"{api}/v1/jobs/{job}/trajectories", params=params) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    lines.append(line)
        assert lines == [lines[0]] and '"t0"' in lines[0]

    # The CLI's client asks again through an election (a 503 before the answer begins) and reads again a stream
    # cut short, giving each line once: all three, in order, once each.
    calls, fail = (
        0,
        {1: ServiceUnavailableError(code=503, description="no leader"), 3: ConnectionClosedError()},
    )
    client = LoomClient(api, API_TOKEN)
    try:
        got = await asyncio.to_thread(
            lambda: [json.loads(x)["traj_id"] for x in client.trajectories(job, page=1)]
        )
    finally:
        client.close()
    assert got == ["t0", "t1", "t2"] and calls == 7

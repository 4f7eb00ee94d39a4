"""A job's breaker sees every finished trajectory once, however the scheduler learns of it first.

A result is stored before its TrajDone event is sent, and the scheduler's reconcile recounts a job from the
store when the store holds more than its events said. CI once ran a job of two trajectories that both failed
with one cause, and it ended "completed": a reconcile had taken both from the store between their storing and
their events, and the events then found them counted, so the breaker never saw them."""

from __future__ import annotations

import asyncio
import time

from loom.protocol import Job, JobSpec, TaskSpec, TrajDone, Trajectory, encode, subjects
from loom.runtime import results
from loom.runtime.service import Runtime
from loom_cli.deploy import free_port
from services.scheduler.__main__ import Scheduler
from services.scheduler.jobs import JobManager
from services.scheduler.settings import SchedulerSettings
from services.scheduler.tasks import traj_id
from tests.conftest import API_TOKEN, Services
from tests.integration.helpers import api_answers, start_worker, until

CAUSE = "step 0 raised ValueError: bad move"


def _failed(job_id: str, group: int) -> Trajectory:
    now = time.time()
    return Trajectory(
        job_id,
        traj_id(group, 0),
        f"t{group}",
        group,
        0,
        "tests.integration.user_envs:RaisesInStep",
        "failed",
        CAUSE,
        [],
        now,
        now,
    )


async def _running_job(services: Services, settings: SchedulerSettings) -> tuple[Runtime, JobManager, Job]:
    """A scheduler and a running job of two trajectories whose breaker trips on both failing."""
    held: list[Scheduler] = []

    def build(rt: Runtime) -> Scheduler:
        held.append(Scheduler(rt, settings))
        return held[0]

    rt = await services.start("scheduler", "scheduler", settings, build)
    await api_answers(f"http://127.0.0.1:{settings.port}", within_s=5)
    # A worker, so that the job is placed and runs; no environment manager takes its trajectories, so they
    # finish only as the test says they do.
    await start_worker(services, "w0")
    jobs = held[0].jobs
    spec = JobSpec(
        env="tests.integration.user_envs:RaisesInStep",
        tasks=[TaskSpec(id="t0"), TaskSpec(id="t1")],
        group_size=1,
        fail_fast=2,
    )
    job = await jobs.submit(spec)
    await until(lambda: jobs.jobs[job.id].state == "running", within_s=10)
    return rt, jobs, job


async def test_a_reconcile_between_a_result_and_its_event_keeps_the_breaker_seeing_it(
    services: Services,
) -> None:
    settings = SchedulerSettings(port=free_port(), api_token=API_TOKEN, reconcile_s=3600)
    rt, jobs, job = await _running_job(services, settings)
    trajs = [_failed(job.id, g) for g in range(2)]
    for t in trajs:
        assert await results.publish_result(rt.js, t)
    await jobs.reconcile()  # finds both in the store before their events
    for t in trajs:
        ev = TrajDone(t.job_id, t.traj_id, t.status, None, 0, 0, t.task_id, t.group, results.cause(CAUSE))
        await rt.nc.publish(subjects.traj_done(job.id), encode(ev))
    await until(lambda: jobs.jobs[job.id].state != "running", within_s=10)
    ended = jobs.jobs[job.id]
    assert ended.state == "failed" and ended.failed == 2 and ended.completed == 0, ended
    assert ended.error == f"the first 2 trajectories to finish all failed: {CAUSE}", ended.error


async def test_a_progress_save_while_the_breaker_trips_never_completes_the_job(services: Services) -> None:
    """The breaker trips on the trajectory that also completes the job; a progress save (or a reconcile)
    counting the job meanwhile must not end it "completed" first (CI saw a client read "completed" a
    millisecond before the job turned "failed"). The interleaving is forced: the jobs' lock is held while the
    trip and the refresh both start, then let go."""
    settings = SchedulerSettings(
        port=free_port(), api_token=API_TOKEN, reconcile_s=3600, progress_save_s=3600
    )
    _, jobs, job = await _running_job(services, settings)
    events = [
        TrajDone(job.id, t.traj_id, t.status, None, 0, 0, t.task_id, t.group, results.cause(CAUSE))
        for t in (_failed(job.id, g) for g in range(2))
    ]
    await jobs._on_traj_done(events[0], None)  # one of two: the breaker waits for the second
    states: list[str] = []
    async with jobs._lock:
        trip = asyncio.create_task(jobs._on_traj_done(events[1], None))
        await asyncio.sleep(0.05)
        refresh = asyncio.create_task(jobs._refresh(job.id, recount=False))
        await asyncio.sleep(0.2)
        states.append(jobs.jobs[job.id].state)
    await asyncio.gather(trip, refresh)
    ended = jobs.jobs[job.id]
    assert states == ["running"] and ended.state == "failed", (states, ended.state)
    assert ended.failed == 2 and ended.completed == 0, ended

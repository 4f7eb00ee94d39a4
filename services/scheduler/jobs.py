"""The scheduler's job control plane: intake, placement, dispatch, progress, cancellation, recovery.

Everything durable lives in JetStream: job records in KV ``loom_jobs``, trajectory placement in KV
``loom_traj``, queued trajectories in the work stream, results in the result stream. After a restart the
manager reloads jobs and recounts their results from the result stream's headers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from nats.aio.msg import Msg

from loom.policies.placement import RoundRobinPlacement
from loom.protocol import (
    PLAN_KEY,
    TERMINAL_JOB_STATES,
    AbortRequest,
    CancelJob,
    Job,
    JobSpec,
    JobState,
    TrajDone,
    TrajMeta,
    TrajWork,
    decode,
    encode,
    subjects,
)
from loom.runtime import results
from loom.runtime.bus import kv_key, kv_values, open_kv, through_failover
from loom.runtime.service import Runtime
from loom.runtime.workers import WorkerInfo, read_workers
from services.scheduler.breaker import Breaker
from services.scheduler.planning import plan
from services.scheduler.settings import SchedulerSettings
from services.scheduler.tasks import (
    SpecError,
    check_context,
    expand,
    resolve_tasks,
    samples_per_group,
    work_subject,
)

T = TypeVar("T")

log = logging.getLogger(__name__)


class QuotaExceeded(Exception):
    """The tenant's trajectories in flight would pass its quota (429: try again once some finish)."""


class JobTooLarge(Exception):
    """The job's record does not fit in one bus message (413)."""


class NotActing(Exception):
    """This scheduler lost its lease: another writes the job records now, and nothing was written (503)."""


def _breaker(job: Job) -> Breaker:
    return Breaker(min(job.spec.fail_fast, job.n_trajectories))


def _chunks(items: list[T], n: int) -> list[list[T]]:
    return [items[i : i + n] for i in range(0, len(items), n)]


class JobManager:
    def __init__(self, rt: Runtime, settings: SchedulerSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.jobs: dict[str, Job] = {}
        # A tenant's quota counts its streams' trajectories in flight beside its jobs' (the scheduler wires it).
        self.streams_in_flight: Callable[[str], int] = lambda _: 0
        # job -> traj -> status of every stored result (deduplicated by trajectory).
        self.done: dict[str, dict[str, str]] = {}
        self.breakers: dict[str, Breaker] = {}  # of the jobs in ``done``
        self.placement = RoundRobinPlacement()
        self._lock = asyncio.Lock()
        self._starting: set[str] = set()  # jobs being placed and dispatched
        self._launching: set[asyncio.Task[None]] = set()
        self._saving: dict[str, asyncio.TimerHandle] = {}  # jobs whose progress save is scheduled
        # False once this instance lost its lease (``stop_acting``): what it still had scheduled or in flight
        # must not overwrite the records its successor keeps.
        self.acting = True
        m = rt.metrics
        self.m_jobs = m.counter("jobs_submitted_total", "Jobs accepted")
        self.m_trajs = m.counter("trajectories_dispatched_total", "Trajectories queued for environments")
        self.m_active = m.gauge("jobs_active", "Jobs pending or running")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # A standby takes over when a nats-server died as often as not (the lease's stream lost its leader too):
        # what it reads to take over is read again through the elections.
        self.kv_jobs = await open_kv(self.rt.js, subjects.KV_JOBS)
        self.kv_traj = await open_kv(self.rt.js, subjects.KV_TRAJ)
        await self._reload()
        await self.rt.subscribe(subjects.TRAJ_DONE_ALL, TrajDone, self._on_traj_done)
        # A cancel, wherever it comes from, ends the job's record as cancelled (not "running" for ever).
        await self.rt.subscribe(subjects.CONTROL_CANCEL, CancelJob, self._on_cancel)

    async def _reload(self) -> None:
        for value in await kv_values(self.rt.js, self.kv_jobs, subjects.KV_JOBS):
            job = decode(value, Job)
            if job.kind == "stream":
                continue  # the stream manager's
            self.jobs[job.id] = job
            if job.state not in TERMINAL_JOB_STATES:
                self.done[job.id] = {}
                self.breakers[job.id] = _breaker(job)
        # In the order they were stored, as the breaker first saw them: one that trips here (its job's end
        # was not saved before the last scheduler died) ends its job now.
        tripped: dict[str, str] = {}
        for h in await through_failover(functools.partial(results.scan_headers, self.rt.js)):
            cause = self._finished(h.job_id, h.traj_id, h.status, h.finish_reason)
            if cause is not None:
                tripped[h.job_id] = cause
        for job_id, cause in tripped.items():
            await self._trip(job_id, cause)
        log.info("reloaded %d jobs (%d active)", len(self.jobs), len(self.done))

    async def reconcile_forever(self) -> None:
        while not self.rt.stopping.is_set():
            try:
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed")
            await self.rt.wait_stop(self.settings.reconcile_s)

    async def reconcile(self) -> None:
        for job in list(self.jobs.values()):
            if job.state == "pending":
                await self._launch(job)
            elif job.state == "running":
                await self._refresh(job.id)
        self.m_active.set(sum(1 for j in self.jobs.values() if j.state not in TERMINAL_JOB_STATES))

    # ------------------------------------------------------------------ intake

    async def submit(self, spec: JobSpec) -> Job:
        """Validate and store the job; its placement and dispatch run in the background (or wait, pending,
        for workers), so a large job never holds up other requests."""
        tasks = resolve_tasks(spec, self.settings.traces_path)  # raises SpecError
        check_context(spec, (await read_workers(self.rt.js)).values())
        spec = msgspec.structs.replace(spec, tasks=tasks)
        n = len(tasks) * samples_per_group(spec)
        if n > self.settings.max_job_trajectories:
            raise SpecError(
                ["group_size"],
                f"{n} trajectories ({len(tasks)} tasks x {samples_per_group(spec)} samples): a job may have "
                f"at most {self.settings.max_job_trajectories}",
            )
        in_flight = self.in_flight(spec.tenant) + self.streams_in_flight(spec.tenant)
        if in_flight + n > self.settings.tenant_max_trajectories:
            raise QuotaExceeded(
                f"tenant {spec.tenant!r} has {in_flight} trajectories in flight; {n} more would pass its "
                f"quota of {self.settings.tenant_max_trajectories}"
            )
        job_id = f"job-{uuid.uuid4().hex[:12]}"
        job = Job(id=job_id, spec=spec, state="pending", created_at=self.rt.clock.now(), n_trajectories=n)
        record = encode(job)
        if len(record) > self.rt.nc.max_payload:
            raise JobTooLarge(
                f"the job's record is {len(record)} bytes, over the bus's {self.rt.nc.max_payload}: "
                "give fewer or shorter tasks"
            )
        await self._save(job)
        self.done[job_id] = {}
        self.breakers[job_id] = _breaker(job)
        self.m_jobs.inc()
        log.info("job %s accepted: %d trajectories", job_id, job.n_trajectories)
        task = asyncio.create_task(self._launch(job))
        self._launching.add(task)
        task.add_done_callback(self._launching.discard)
        return self.jobs[job_id]

    def in_flight(self, tenant: str) -> int:
        """Trajectories of the tenant's jobs not yet finished."""
        return sum(
            j.n_trajectories - j.completed - j.failed
            for j in self.jobs.values()
            if j.spec.tenant == tenant and j.state not in TERMINAL_JOB_STATES and j.kind == "job"
        )

    async def _launch(self, job: Job) -> None:
        # The lock covers the decision to launch, not the writing: a cancel meanwhile stops the writing.
        async with self._lock:
            job = self.jobs[job.id]
            if job.state != "pending" or job.id in self._starting:
                return
            workers = await read_workers(self.rt.js)
            if not workers:
                log.info("job %s waits for rollout workers", job.id)
                return
            self._starting.add(job.id)
        try:
            await self._dispatch(job, workers)
        except Exception:
            log.exception("job %s could not be launched; the next reconcile retries", job.id)
        finally:
            self._starting.discard(job.id)

    def _cancelled(self, job_id: str) -> bool:
        """Whether the job was ended while it was being dispatched (cancelled, or failed by its breaker)."""
        return self.jobs[job_id].state in ("cancelled", "failed")

    async def _write_live(self, job_id: str, items: list[T], write: Callable[[T], Awaitable[object]]) -> bool:
        """``write`` every item, 256 at a time, until the job is cancelled or this instance stops acting;
        whether all were written."""
        for chunk in _chunks(items, 256):
            if self._cancelled(job_id) or not self.acting:
                return False
            await asyncio.gather(*(write(x) for x in chunk))
        return True

    async def _dispatch(self, job: Job, workers: dict[str, WorkerInfo]) -> None:
        works = expand(job.id, job.spec)
        placement = await plan(self.rt, job, works, workers, self.placement)

        def meta(w: TrajWork) -> Awaitable[object]:
            record = TrajMeta(
                job_id=job.id,
                traj_id=w.traj_id,
                worker_id=placement.assignments.get(w.traj_id),
                predicted_remaining=placement.predicted.get(w.traj_id),
            )
            return self.kv_traj.put(kv_key(job.id, w.traj_id), encode(record))

        subject = work_subject(job.id, job.spec.env)

        def queue(w: TrajWork) -> Awaitable[object]:
            # Same Nats-Msg-Id on a re-launch after a crash: the stream drops the duplicate.
            headers = {"Nats-Msg-Id": results.msg_id(job.id, w.traj_id)}
            return self.rt.js.publish(subject, encode(w), headers=headers)

        if not await self._write_live(job.id, works, meta):
            return
        # Stored for a restarted router, then announced.
        await self.kv_traj.put(kv_key(job.id, PLAN_KEY), encode(placement))
        await self.rt.nc.publish(subjects.CONTROL_PLACEMENT, encode(placement))
        await self._write_live(job.id, works, queue)
        async with self._lock:
            if self._cancelled(job.id):  # what was queued before the cancel's purge saw it goes too
                await self.rt.js.purge_stream(subjects.STREAM_TRAJWORK, subject=subject)
                return
            self.m_trajs.inc(len(works))
            job = msgspec.structs.replace(self.jobs[job.id], state="running", started_at=self.rt.clock.now())
            await self._save(job)
        log.info("job %s running on %d workers", job.id, len(workers))

    # ------------------------------------------------------------------ progress

    async def _on_traj_done(self, ev: TrajDone, _msg: Msg) -> None:
        seen = self.done.get(ev.job_id)
        if seen is None or not self.acting:
            return
        cause = self._finished(ev.job_id, ev.traj_id, ev.status, ev.cause)
        if cause is not None:
            await self._trip(ev.job_id, cause)
            return
        job = self.jobs.get(ev.job_id)
        if job is not None and len(seen) >= job.n_trajectories:
            await self._refresh(ev.job_id, recount=False)
        elif ev.job_id not in self._saving:
            # Progress is saved in batches: one save per finished trajectory rewrote a 45 KB record each
            # time and made the scheduler the fleet's first bottleneck.
            self._saving[ev.job_id] = asyncio.get_running_loop().call_later(
                self.settings.progress_save_s, self._save_progress, ev.job_id
            )

    def _finished(self, job_id: str, traj_id: str, status: str, cause: str) -> str | None:
        """Count one stored result of an active job, however it was learnt (its event, a reload's or a
        recount's scan of the results): the breaker sees each trajectory once, the first time. Returns the
        cause the job's breaker trips on, if it does."""
        seen = self.done.get(job_id)
        if seen is None or traj_id in seen:
            return None
        seen[traj_id] = status
        return self.breakers[job_id].see(status, cause)

    def _save_progress(self, job_id: str) -> None:
        self._saving.pop(job_id, None)
        task = asyncio.create_task(self._refresh(job_id, recount=False))
        self._launching.add(task)
        task.add_done_callback(self._launching.discard)

    async def _refresh(self, job_id: str, recount: bool = True) -> None:
        job = self.jobs.get(job_id)
        seen = self.done.get(job_id)
        if job is None or seen is None or job.state in TERMINAL_JOB_STATES:
            return
        if recount and await results.count_results(self.rt.js, job_id) > len(seen):
            # Events were missed, or are on their way (a result is stored before its event is sent): what the
            # scan finds first, the breaker sees here, as the event would have shown it (CI once saw a job of
            # two failed trajectories end "completed": a reconcile took both from the store, and their events
            # then found them seen).
            for h in await results.scan_headers(self.rt.js, job_id):
                cause = self._finished(job_id, h.traj_id, h.status, h.finish_reason)
                if cause is not None:
                    await self._trip(job_id, cause)
                    return
        # Under the lock, as every end is: the job may have ended while this counted (a cancel, or its breaker
        # tripping on the trajectory that completes it, which takes the job's count at once in ``_trip``). CI
        # once saw a job of two failed trajectories turn "completed" here and "failed" a millisecond later.
        async with self._lock:
            job = self.jobs[job_id]
            if job.state in TERMINAL_JOB_STATES or self.done.get(job_id) is not seen:
                return
            completed = sum(1 for s in seen.values() if s == "completed")
            failed = len(seen) - completed
            if (completed, failed) == (job.completed, job.failed):
                return
            changes: dict[str, object] = {"completed": completed, "failed": failed}
            if completed + failed >= job.n_trajectories and job.state == "running":
                changes.update(state="completed", finished_at=self.rt.clock.now())
                log.info("job %s completed: %d ok, %d failed", job_id, completed, failed)
            await self._save(msgspec.structs.replace(job, **changes))
            if self.jobs[job_id].state in TERMINAL_JOB_STATES:
                self.done.pop(job_id, None)
                self.breakers.pop(job_id, None)

    # ------------------------------------------------------------------ cancel

    async def _on_cancel(self, c: CancelJob, _msg: Msg) -> None:
        job = self.jobs.get(c.job_id)
        if job is not None and job.kind == "job" and job.state not in TERMINAL_JOB_STATES:
            log.warning("job %s cancelled on the bus, not through the API", c.job_id)
            await self.cancel(c.job_id)

    async def cancel(self, job_id: str) -> Job:
        return await self._end(job_id, "cancelled")

    async def _trip(self, job_id: str, cause: str) -> None:
        first = self.breakers[job_id].first
        # Taken now, before anything waits: from here no refresh can complete the job (``_refresh``).
        seen = self.done.pop(job_id, {})
        error = f"the first {first} trajectories to finish all failed: {cause}"
        await self._end(job_id, "failed", error, seen)

    async def _end(
        self, job_id: str, state: JobState, error: str | None = None, seen: dict[str, str] | None = None
    ) -> Job:
        """End the job as ``state`` (cancelled, or failed by its breaker, which gives what it ``seen``) with
        what finished so far counted; what is queued is dropped, what runs stops with its engine requests."""
        async with self._lock:
            job = self.jobs[job_id]
            if job.state in TERMINAL_JOB_STATES:
                return job
            seen = self.done.pop(job_id, seen if seen is not None else {})
            self.breakers.pop(job_id, None)
            completed = sum(1 for s in seen.values() if s == "completed")
            job = msgspec.structs.replace(
                job,
                state=state,
                finished_at=self.rt.clock.now(),
                error=error,
                completed=max(job.completed, completed),
                failed=max(job.failed, len(seen) - completed),
            )
            await self._save(job)
        if error:
            log.warning("job %s %s: %s", job_id, state, error)
        # Drop queued trajectories, then stop running ones and their engine requests.
        await self.rt.js.purge_stream(subjects.STREAM_TRAJWORK, subject=subjects.traj_work(job_id))
        # And what waits in the library lanes (gem: work goes to managers of its own).
        await self.rt.js.purge_stream(subjects.STREAM_TRAJWORK, subject=subjects.traj_work_lanes(job_id))
        await self.rt.nc.publish(subjects.CONTROL_CANCEL, encode(CancelJob(job_id)))
        await self.rt.nc.publish(subjects.GEN_ABORT, encode(AbortRequest(job_id=job_id)))
        log.info("job %s %s", job_id, state)
        return job

    # ------------------------------------------------------------------ store

    def stop_acting(self) -> None:
        """This instance lost its lease: its successor reloads every job from the bus and keeps its records
        from now on. Cancel the progress saves and launches still pending here and write nothing more (they
        went on until the process exited, seconds after the successor took over, and could overwrite a record
        it had since advanced, a completed job back to running)."""
        self.acting = False
        for timer in self._saving.values():
            timer.cancel()
        self._saving.clear()
        for task in list(self._launching):
            task.cancel()

    async def _save(self, job: Job) -> None:
        if not self.acting:
            raise NotActing(
                f"job {job.id}: this scheduler lost its lease, and its successor keeps the record"
            )
        await self.kv_jobs.put(job.id, encode(job))
        self.jobs[job.id] = job

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def health(self) -> dict[str, object]:
        by_state: dict[str, int] = {}
        for j in self.jobs.values():
            by_state[j.state] = by_state.get(j.state, 0) + 1
        return {"jobs": by_state, "at": time.time()}

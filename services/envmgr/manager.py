"""The environment manager: one asyncio task per trajectory, fed from the durable trajectory work queue.

A trajectory's work message is acknowledged only after its result has been handed to the reward queue, so
a manager that dies mid-trajectory leaves it to be redelivered; the reward and result streams dedupe by
trajectory, and finished trajectories are skipped on redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from loom import results
from loom.bus import kv_key
from loom.genclient import GenClient
from loom.protocol import (
    TERMINAL_JOB_STATES,
    AbortRequest,
    CancelJob,
    DecodeError,
    Job,
    RewardRequest,
    Trajectory,
    TrajMeta,
    TrajWork,
    decode,
    encode,
    subjects,
)
from loom.service import Runtime
from loom.workqueue import WorkQueueConsumer
from services.envmgr.replay import LoopContext, TrajectoryAborted, run_replay
from services.envmgr.settings import EnvmgrSettings

log = logging.getLogger(__name__)

DURABLE = "envmgr"


@dataclass
class Running:
    work: TrajWork
    msg: Msg
    task: asyncio.Task[Any] | None = None
    cancelled_by_job: bool = False


class EnvManager:
    def __init__(self, rt: Runtime, settings: EnvmgrSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.running: dict[str, Running] = {}
        self.cancelled_jobs: set[str] = set()
        m = rt.metrics
        self.m_trajs = m.counter("trajectories_total", "Trajectories finished", ["outcome"])
        self.m_steps = m.counter("steps_total", "LLM steps taken")
        self.m_active = m.gauge("active_trajectories", "Trajectories running")
        self.m_traj_s = m.histogram("trajectory_seconds", "Trajectory duration (simulated)")

    def health(self) -> dict[str, Any]:
        return {"active": len(self.running), "cancelled_jobs": len(self.cancelled_jobs)}

    async def run(self, rt: Runtime) -> None:
        self.kv_jobs = await rt.js.key_value(subjects.KV_JOBS)
        self.kv_traj = await rt.js.key_value(subjects.KV_TRAJ)
        self.ctx = LoopContext(
            nc=rt.nc,
            clock=rt.clock,
            gen=GenClient(rt.nc, lease_s=self.settings.lease_s, give_up_s=self.settings.gen_give_up_s),
            predict_timeout_s=self.settings.predict_timeout_s,
        )
        await rt.subscribe(subjects.CONTROL_CANCEL, CancelJob, self.on_cancel)
        consumer = WorkQueueConsumer(
            rt,
            stream=subjects.STREAM_TRAJWORK,
            subject=subjects.STREAM_TRAJWORK_SUBJECTS[0],
            durable=DURABLE,
            ack_wait_s=self.settings.ack_wait_s,
            capacity=self.settings.concurrency,
            handler=self._accept,
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(consumer.run())
            tg.create_task(self._progress_forever())
        # Shutting down: stop every trajectory and return it to the queue for another manager.
        await consumer.finish(0)

    async def _accept(self, m: Msg) -> None:
        try:
            work = decode(m.data, TrajWork)
        except DecodeError as e:
            await self.rt.dead_letter(m.subject, f"bad trajectory work: {e}", m.data)
            await m.term()
            return
        key = kv_key(work.job_id, work.traj_id)
        if key in self.running:
            return  # a redelivery of what we are running: the in-progress heartbeat will catch up
        if await self._job_over(work.job_id) or await self._traj_done(key):
            await m.ack()
            return
        r = self.running[key] = Running(work, m, asyncio.current_task())
        self.m_active.set(len(self.running))
        await self._run_one(key, r)

    async def _job_over(self, job_id: str) -> bool:
        if job_id in self.cancelled_jobs:
            return True
        try:
            entry = await self.kv_jobs.get(job_id)
        except KeyNotFoundError:
            return False
        if entry.value and decode(entry.value, Job).state in TERMINAL_JOB_STATES:
            self.cancelled_jobs.add(job_id)
            return True
        return False

    async def _traj_done(self, key: str) -> bool:
        try:
            entry = await self.kv_traj.get(key)
        except KeyNotFoundError:
            return False
        return entry.value is not None and decode(entry.value, TrajMeta).state in ("done", "failed")

    async def _run_one(self, key: str, r: Running) -> None:
        w = r.work
        outcome = "completed"
        try:
            try:
                traj = await run_replay(w, self.ctx)
            except asyncio.CancelledError:
                if not r.cancelled_by_job:
                    outcome = "handed_back"
                    await r.msg.nak()
                    raise
                outcome = "cancelled"
                await r.msg.ack()
                return
            except Exception as e:
                outcome = "failed"
                log.warning("trajectory %s failed: %s", key, e)
                traj = self._failed(w, e)
            self.m_steps.inc(len(traj.steps))
            self.m_traj_s.observe(traj.finished_at - traj.started_at)
            # Reward request first, ack second: a crash between them redelivers, and the streams dedupe.
            await self.rt.js.publish(
                subjects.reward_submit(w.job_id),
                encode(RewardRequest(traj)),
                headers={"Nats-Msg-Id": results.msg_id(w.job_id, w.traj_id)},
            )
            await r.msg.ack()
        finally:
            self.m_trajs.labels(outcome).inc()
            self.running.pop(key, None)
            self.m_active.set(len(self.running))

    def _failed(self, w: TrajWork, e: Exception) -> Trajectory:
        now = self.rt.clock.now()
        reason = "aborted" if isinstance(e, TrajectoryAborted) else f"error: {type(e).__name__}: {e}"
        return Trajectory(
            job_id=w.job_id,
            traj_id=w.traj_id,
            task_id=w.task.id,
            group=w.group,
            sample=w.sample,
            env=w.env,
            status="aborted" if isinstance(e, TrajectoryAborted) else "failed",
            finish_reason=reason[:500],
            steps=[],
            started_at=now,
            finished_at=now,
            info={k: v for k, v in w.task.data.items() if isinstance(v, str)},
        )

    async def _progress_forever(self) -> None:
        """Keep the work messages of running trajectories from being redelivered."""
        period = self.settings.ack_wait_s / 3
        while not self.rt.stopping.is_set():
            for r in list(self.running.values()):
                with contextlib.suppress(Exception):
                    await r.msg.in_progress()
            await self.rt.wait_stop(period)

    async def on_cancel(self, c: CancelJob, _msg: Msg) -> None:
        self.cancelled_jobs.add(c.job_id)
        n = 0
        for r in list(self.running.values()):
            if r.work.job_id == c.job_id and r.task is not None:
                r.cancelled_by_job = True
                r.task.cancel()
                n += 1
        await self.rt.nc.publish(subjects.GEN_ABORT, encode(AbortRequest(job_id=c.job_id)))
        log.info("job %s cancelled: stopped %d trajectories", c.job_id, n)

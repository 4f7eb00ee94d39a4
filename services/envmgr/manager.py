"""The environment manager: one asyncio task per trajectory, fed from the durable trajectory work queue.

A trajectory's work message is acknowledged only after its result has been handed to the reward queue, so
a manager that dies mid-trajectory leaves it to be redelivered; the reward and result streams dedupe by
trajectory, and finished trajectories are skipped on redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, NotFoundError

from loom.envs import registry
from loom.policies.staleness import AsyncBound
from loom.protocol import (
    TERMINAL_JOB_STATES,
    AbortRequest,
    CancelJob,
    DecodeError,
    GroupDone,
    GroupRestart,
    Job,
    RewardRequest,
    Stream,
    StreamVersion,
    Trajectory,
    TrajMeta,
    TrajWork,
    decode,
    encode,
    subjects,
)
from loom.runtime import results
from loom.runtime.bus import kv_key, through_failover
from loom.runtime.genclient import GenClient
from loom.runtime.service import Runtime
from loom.runtime.workers import ContextLimits
from loom.runtime.workqueue import WorkQueueConsumer
from loom.sandbox.settings import OnDemandSandboxes
from services.envmgr.context import EnvMetrics, LoopContext, TrajectoryAborted, trajectory
from services.envmgr.env_loop import run_env
from services.envmgr.external import run_external
from services.envmgr.groups import GroupLedger
from services.envmgr.replay import run_replay
from services.envmgr.settings import EnvmgrSettings
from services.envmgr.user_loop import env_class, needs_sandbox, run_user_env

log = logging.getLogger(__name__)

DURABLE = "envmgr"


def durable(lane: str) -> str:
    """The durable consumer of a lane (the main lane's keeps the name it had before lanes existed)."""
    return DURABLE if lane == subjects.MAIN_LANE else f"{DURABLE}-{lane}"


async def narrow_legacy_consumer(js: JetStreamContext) -> None:
    """A store kept from before lanes has the main consumer taking all of ``trajwork.>``: it would take the
    library lanes' work too, and no lane's consumer can be made beside it (filters on a work-queue stream must
    not overlap). Narrow it to the main lane; its pending work and acknowledgements stay."""
    try:
        info = await js.consumer_info(subjects.STREAM_TRAJWORK, DURABLE)
    except NotFoundError:
        return
    if info.config.filter_subject in subjects.STREAM_TRAJWORK_SUBJECTS:
        narrowed = dataclasses.replace(
            info.config, filter_subject=subjects.traj_work_filter(subjects.MAIN_LANE)
        )
        await js.add_consumer(subjects.STREAM_TRAJWORK, narrowed)
        log.info("narrowed consumer %s to the main lane", DURABLE)


@dataclass
class Running:
    work: TrajWork
    msg: Msg
    task: asyncio.Task[Any] | None = None
    cancelled_by_job: bool = False
    # Cancelled because its group already has its samples (redundant rollouts).
    redundant: bool = False
    # Rollout streams: the policy version that started it, and why the bound or its group stopped it.
    start_version: int | None = None
    stale: str = ""
    restarted: bool = False


class Redundant(Exception):
    """A redundant sample whose group finished without it."""


class Stale(Exception):
    """A stream's trajectory that the asynchronous bound no longer admits."""


class GroupGone(Exception):
    """A stream's group was restarted before this sample began: nothing to run and nothing to store."""


class EnvManager:
    def __init__(self, rt: Runtime, settings: EnvmgrSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.running: dict[str, Running] = {}
        self.cancelled_jobs: set[str] = set()
        # Rollout streams: the policy version each has reached, as broadcast after its fleet updates.
        self.versions: dict[str, int] = {}
        m = rt.metrics
        self.m_trajs = m.counter("trajectories_total", "Trajectories finished", ["outcome"])
        self.m_steps = m.counter("steps_total", "LLM steps taken")
        self.m_active = m.gauge("active_trajectories", "Trajectories running")
        self.m_traj_s = m.histogram("trajectory_seconds", "Trajectory duration (simulated)")
        self.env_metrics = EnvMetrics(
            reset_s=m.histogram("env_reset_seconds", "Environment reset latency (wall)", ["env"]),
            step_s=m.histogram("env_step_seconds", "Tool call latency (wall)", ["env", "tool"]),
            failures=m.counter("env_failures_total", "Environment failures", ["env", "kind"]),
        )
        self.m_pool = m.gauge("sandboxes", "Sandboxes by state", ["state"])
        self.sandboxes = OnDemandSandboxes(settings, settings.instance)
        self.job_slots: dict[str, asyncio.Semaphore] = {}

    def health(self) -> dict[str, Any]:
        h: dict[str, Any] = {"active": len(self.running), "cancelled_jobs": len(self.cancelled_jobs)}
        pool = self.sandboxes.pool
        if pool is not None:
            st = pool.snapshot()
            h["sandbox"] = {"backend": pool.backend_name, "warm": st.warm, "in_use": st.in_use}
        return h

    async def run(self, rt: Runtime) -> None:
        self.kv_jobs = await rt.js.key_value(subjects.KV_JOBS)
        self.kv_traj = await rt.js.key_value(subjects.KV_TRAJ)
        self.kv_streams = await rt.js.key_value(subjects.KV_STREAMS)
        self.ctx = LoopContext(
            nc=rt.nc,
            clock=rt.clock,
            gen=GenClient(rt.nc, lease_s=self.settings.lease_s, give_up_s=self.settings.gen_give_up_s),
            predict_timeout_s=self.settings.predict_timeout_s,
            metrics=self.env_metrics,
            limits=ContextLimits(rt.js),
        )
        self.groups = GroupLedger(await rt.js.key_value(subjects.KV_GROUPS))
        await rt.subscribe(subjects.CONTROL_CANCEL, CancelJob, self.on_cancel)
        await rt.subscribe(subjects.CONTROL_GROUP_DONE, GroupDone, self.on_group_done)
        await rt.subscribe(subjects.CONTROL_GROUP_RESTART, GroupRestart, self.on_group_restart)
        await rt.subscribe(subjects.CONTROL_VERSION, StreamVersion, self.on_version)
        await narrow_legacy_consumer(rt.js)
        # Serving: a cancel or a group's end published before its subscription would have passed it by.
        # Trajectory work waits in its stream for the consumers.
        rt.mark_ready()
        # One durable consumer per lane this manager serves, shared with every other manager serving it.
        consumers = [
            WorkQueueConsumer(
                rt,
                stream=subjects.STREAM_TRAJWORK,
                subject=subjects.traj_work_filter(lane),
                durable=durable(lane),
                ack_wait_s=self.settings.ack_wait_s,
                capacity=self.settings.concurrency,
                handler=self._accept,
            )
            for lane in self.settings.lane_list()
        ]
        try:
            async with asyncio.TaskGroup() as tg:
                for consumer in consumers:
                    tg.create_task(consumer.run())
                tg.create_task(self._progress_forever())
            # Shutting down: stop every trajectory and return it to the queue for another manager.
            await asyncio.gather(*(c.finish(0) for c in consumers))
        finally:
            await self.sandboxes.close()

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
        try:
            await self._run_one(key, r)
        finally:
            self.running.pop(key, None)
            self.m_active.set(len(self.running))

    def _slots(self, w: TrajWork) -> asyncio.Semaphore | contextlib.nullcontext[None]:
        if w.env_concurrency is None:
            return contextlib.nullcontext()
        return self.job_slots.setdefault(w.job_id, asyncio.Semaphore(w.env_concurrency))

    async def _job_over(self, job_id: str) -> bool:
        if job_id in self.cancelled_jobs:
            return True
        try:
            entry = await through_failover(lambda: self.kv_jobs.get(job_id))
        except KeyNotFoundError:
            return False
        if entry.value and decode(entry.value, Job).state in TERMINAL_JOB_STATES:
            self.cancelled_jobs.add(job_id)
            return True
        return False

    async def _traj_done(self, key: str) -> bool:
        try:
            entry = await through_failover(lambda: self.kv_traj.get(key))
        except KeyNotFoundError:
            return False
        return entry.value is not None and decode(entry.value, TrajMeta).state in ("done", "failed")

    async def _stream_version(self, job_id: str) -> int:
        if job_id not in self.versions:
            try:
                entry = await through_failover(lambda: self.kv_streams.get(job_id))
                stored = decode(entry.value, Stream).version if entry.value else 0
            except KeyNotFoundError:
                stored = 0
            # A broadcast may have come in while the record was read.
            self.versions[job_id] = max(stored, self.versions.get(job_id, 0))
        return self.versions[job_id]

    async def _run(self, w: TrajWork, r: Running) -> Trajectory:
        async with self._slots(w):
            if w.redundancy and await self.groups.full(w):
                raise Redundant("its group already had its samples")
            if w.async_bound is not None:
                if await self.groups.restarted(w):
                    raise GroupGone(f"group {w.group} was restarted")
                # The version that initiates generation (RollArt's definition); the bound is measured from it.
                r.start_version = await self._stream_version(w.job_id)
            env = registry.resolve(w.env)
            loop = env.loop
            if loop == "replay":
                return await run_replay(w, self.ctx)
            if loop == "external":
                return await run_external(w, self.ctx)
            if loop == "verifiers":
                from services.envmgr import verifiers_loop  # verifiers and openai are optional

                return await verifiers_loop.run_verifiers(w, self.ctx)
            if loop == "user":
                # A library's environment class, or a user's by import path (a first import runs its top level).
                cls = await asyncio.to_thread(registry.user_class, w.env, env_class)
                pool = await self.sandboxes.get() if needs_sandbox(cls) else None
                return await run_user_env(w, self.ctx, cls, pool)
            pool = await self.sandboxes.get() if env.sandboxed else None
            return await run_env(w, self.ctx, pool, env.sandboxed)

    async def _run_one(self, key: str, r: Running) -> None:
        w = r.work
        outcome = "completed"
        try:
            try:
                traj = await self._run(w, r)
                if w.redundancy:
                    traj = await self._keep_or_drop(traj, w)
            except asyncio.CancelledError:
                if r.redundant:
                    outcome = "redundant"
                    traj = self._failed(w, Redundant("its group finished first"))
                elif r.stale:
                    outcome = "stale"
                    traj = self._failed(w, Stale(r.stale))
                elif r.restarted:
                    outcome = "restarted"
                    await r.msg.ack()
                    return
                elif not r.cancelled_by_job:
                    outcome = "handed_back"
                    await r.msg.nak()
                    raise
                else:
                    outcome = "cancelled"
                    await r.msg.ack()
                    return
            except GroupGone:
                outcome = "restarted"
                await r.msg.ack()
                return
            except Redundant as e:
                outcome = "redundant"
                traj = self._failed(w, e)
            except Exception as e:
                outcome = "failed"
                kind = type(e).__name__
                self.env_metrics.failures.labels(w.env, kind).inc()
                log.warning("trajectory %s failed: %s", key, e)
                traj = self._failed(w, e)
            if r.start_version is not None:
                traj = msgspec.structs.replace(traj, start_version=r.start_version)
            self.m_steps.inc(len(traj.steps))
            self.m_traj_s.observe(traj.finished_at - traj.started_at)
            try:
                payload = encode(RewardRequest(traj, reward_of(w, traj), w.tenant, w.task, w.reward_params))
            except (TypeError, ValueError, OverflowError) as e:
                # What the trajectory carries cannot be stored: it fails, with the reason, rather than come back.
                outcome = "failed"
                traj = self._failed(w, e)
                payload = encode(RewardRequest(traj, w.reward, w.tenant, w.task, w.reward_params))
            # Reward request first, ack second: a crash between them redelivers, and the streams dedupe (so the
            # publish may be asked again while its stream elects a leader; failing, it ran the whole trajectory
            # again once its work was redelivered).
            await through_failover(
                lambda: self.rt.js.publish(
                    subjects.reward_submit(w.tenant, w.job_id),
                    payload,
                    headers={"Nats-Msg-Id": results.msg_id(w.job_id, w.traj_id)},
                )
            )
            await r.msg.ack()
        finally:
            self.m_trajs.labels(outcome).inc()
            if self.sandboxes.pool is not None:
                st = self.sandboxes.pool.snapshot()
                for state in ("warm", "in_use", "creating"):
                    self.m_pool.labels(state).set(getattr(st, state))

    async def _keep_or_drop(self, traj: Trajectory, w: TrajWork) -> Trajectory:
        """Redundant rollouts: the first group_size completed samples of a group are kept."""
        if traj.status != "completed":
            return traj
        kept = await self.groups.claim(w)
        if kept is None:
            raise Redundant("its group already had its samples")
        if len(kept) == w.group_size:
            await self.rt.nc.publish(subjects.CONTROL_GROUP_DONE, encode(GroupDone(w.job_id, w.group, kept)))
        return traj

    def _failed(self, w: TrajWork, e: Exception) -> Trajectory:
        now = self.rt.clock.now()
        aborted = isinstance(e, TrajectoryAborted | Redundant | Stale)
        reason = (
            f"redundant: {e}"
            if isinstance(e, Redundant)
            else f"stale: {e}"
            if isinstance(e, Stale)
            else "aborted"
            if isinstance(e, TrajectoryAborted)
            else f"error: {type(e).__name__}: {e}"
        )
        return trajectory(
            w,
            "aborted" if aborted else "failed",
            reason[:500],
            [],
            now,
            now,
            {k: v for k, v in w.task.data.items() if isinstance(v, str)},
        )

    async def _progress_forever(self) -> None:
        """Keep the work messages of running trajectories from being redelivered."""
        period = self.settings.ack_wait_s / 3
        while not self.rt.stopping.is_set():
            for r in list(self.running.values()):
                with contextlib.suppress(Exception):
                    await r.msg.in_progress()
            await self.rt.wait_stop(period)

    async def on_group_done(self, g: GroupDone, _msg: Msg) -> None:
        """Abort this group's other samples; cancelling their loops aborts their engine requests."""
        kept = set(g.kept)
        for r in list(self.running.values()):
            w = r.work
            if w.job_id == g.job_id and w.group == g.group and w.traj_id not in kept and r.task is not None:
                r.redundant = True
                r.task.cancel()

    async def on_version(self, v: StreamVersion, _msg: Msg) -> None:
        """The stream's policy moved on: stop the trajectories the bound no longer admits (their engine
        requests are aborted with them); the scheduler samples their groups again."""
        self.versions[v.stream_id] = max(v.version, self.versions.get(v.stream_id, 0))
        bound = AsyncBound(v.async_bound)
        n = 0
        for r in list(self.running.values()):
            s = r.start_version
            if r.work.job_id != v.stream_id or s is None or r.task is None or bound.admits(s, v.version):
                continue
            r.stale = f"started at version {s}, policy now at {v.version}, bound {v.async_bound}"
            r.task.cancel()
            n += 1
        if n:
            log.info("stream %s at version %d: aborted %d stale trajectories", v.stream_id, v.version, n)

    async def on_group_restart(self, g: GroupRestart, _msg: Msg) -> None:
        for r in list(self.running.values()):
            w = r.work
            if w.job_id == g.job_id and w.group == g.group and r.task is not None and not r.stale:
                r.restarted = True
                r.task.cancel()

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


def reward_of(w: TrajWork, traj: Trajectory) -> str:
    """The reward an external agent gave when it finished its session, else the job's reward function."""
    verdict = traj.info.get("verdict")
    if w.env == "external" and isinstance(verdict, dict) and verdict.get("given"):
        return "env"
    return w.reward

"""Reward service controller: a durable work queue, weighted fair dispatch, and autoscaled worker processes.

Reward requests wait in a JetStream work-queue stream, one subject per tenant and job, one pull consumer per
tenant. The controller fetches only what its workers have room for, hands each request to the least loaded
worker, picking tenants by start-time fair queueing on their weights, and acknowledges the stream message
only once the worker says the result is stored. A worker that dies or misses the deadline gets its requests
delivered again; a request that keeps failing, or cannot be scored at all, is dead-lettered with its reason
and its trajectory stored unscored, so that its job still completes. The pool is sized by a pure autoscaler
(Knative's: stable and panic windows, scale to zero) from each tenant's concurrency (queued or running).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from loom.policies.autoscaler import Autoscaler
from loom.policies.fairshare import FairQueue
from loom.protocol import (
    DecodeError,
    RewardAssign,
    RewardOutcome,
    RewardRequest,
    WorkerReady,
    decode,
    encode,
    subjects,
)
from loom.runtime.service import Runtime
from services.reward.settings import RewardSettings
from services.reward.store import store
from services.reward.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

LEGACY_DURABLE = "reward"  # one consumer over every subject, before tenants had their own
KILL_GRACE_S = 2.0


@dataclass
class Tenant:
    name: str
    psub: Any
    buffer: deque[Msg] = field(default_factory=deque)
    inflight: int = 0
    pending: int = 0  # in the stream, not yet acknowledged (queued, buffered or running)
    want: asyncio.Event = field(default_factory=asyncio.Event)


class RewardService:
    def __init__(self, rt: Runtime, settings: RewardSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.tenants: dict[str, Tenant] = {}
        limits = {k: v.limits() for k, v in settings.tenants.items()}
        self.autoscaler = Autoscaler(settings.scale_policy(), limits)
        self.fair = FairQueue({k: v.weight for k, v in settings.tenants.items()})
        self.pool = WorkerPool(settings, self._kick)
        self._wake = asyncio.Event()
        self._scale_wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        m = rt.metrics
        self.m_scored = m.counter("scored_total", "Requests finished", ["tenant", "outcome"])
        self.m_dupes = m.counter("duplicates_total", "Results already stored (redeliveries)")
        self.m_redeliver = m.counter("redeliveries_total", "Requests handed back for another try", ["reason"])
        self.m_latency = m.histogram("request_seconds", "From dispatch to stored result (wall)", ["tenant"])
        self.m_workers = m.gauge("workers", "Worker processes by state", ["state"])
        self.m_desired = m.gauge("desired_workers", "Workers the autoscaler asks for")
        self.m_cold = m.histogram("cold_start_seconds", "Worker spawn to ready")
        self.m_pending = m.gauge("pending", "Requests not yet acknowledged, by tenant", ["tenant"])
        self.m_worker_s = m.gauge("worker_seconds", "Worker-seconds provisioned since start")
        self.m_busy_s = m.gauge("busy_seconds", "Worker-seconds with a request in hand since start")

    def health(self) -> dict[str, Any]:
        ws, bs = self.pool.worker_seconds(), self.pool.busy_seconds()
        return {
            "mode": "fixed" if self.settings.fixed_workers else "autoscaled",
            "workers": [
                {"id": w.id, "pid": w.proc.pid, "ready": w.ready, "inflight": w.inflight}
                for w in self.pool.workers.values()
            ],
            "tenants": {
                t.name: {"pending": t.pending, "inflight": t.inflight} for t in self.tenants.values()
            },
            "worker_seconds": ws,
            "busy_seconds": bs,
            "utilization": bs / ws if ws > 0 else None,
            "cold_starts": self.pool.n_cold_starts,
            "cold_start_ms": [round(c * 1000, 1) for c in self.pool.cold_starts],
            "killed": self.pool.killed,
            "peak_workers": self.pool.peak,
        }

    def _kick(self) -> None:
        self._wake.set()

    def _spawn_task(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def run(self, rt: Runtime) -> None:
        await asyncio.to_thread(WorkerPool.prepare)
        with contextlib.suppress(NotFoundError):
            await rt.js.delete_consumer(subjects.STREAM_REWARD, LEGACY_DURABLE)
        self.kv_traj = await rt.js.key_value(subjects.KV_TRAJ)
        await rt.nc.subscribe(subjects.REWARD_READY, cb=self._on_ready)
        rt.mark_ready()  # its fork server has the reward code, and it listens for new requests
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._scale_forever())
                tg.create_task(self._dispatch_forever())
                await rt.stopping.wait()
                self._wake.set()
        finally:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.pool.close()
            for ten in self.tenants.values():
                with contextlib.suppress(Exception):
                    await ten.psub.unsubscribe()

    # ------------------------------------------------------------------ tenants and their consumers

    async def _add_tenant(self, name: str) -> None:
        """The tenant's durable pull consumer and its feeder (only ``_discover`` adds tenants)."""
        durable = f"reward-{name}"
        cfg = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.settings.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=-1,
            filter_subject=subjects.reward_tenant(name),
        )
        psub = await self.rt.js.pull_subscribe(
            subjects.reward_tenant(name), durable=durable, stream=subjects.STREAM_REWARD, config=cfg
        )
        ten = self.tenants[name] = Tenant(name, psub)
        self._spawn_task(self._feed_forever(ten))

    async def _discover(self) -> None:
        """Tenants with requests in the stream, and how many each has (the autoscaler's concurrency)."""
        info = await self.rt.js.stream_info(
            subjects.STREAM_REWARD, subjects_filter=subjects.STREAM_REWARD_SUBJECTS[0]
        )
        counts: dict[str, int] = {}
        for subj, n in (info.state.subjects or {}).items():
            name = subjects.tenant_of_reward_subject(subj)
            counts[name] = counts.get(name, 0) + n
        for name in counts:
            if name not in self.tenants:
                await self._add_tenant(name)
        for ten in self.tenants.values():
            ten.pending = counts.get(ten.name, 0)
            if ten.pending > len(ten.buffer) + ten.inflight:
                ten.want.set()

    async def _feed_forever(self, ten: Tenant) -> None:
        """Keep a few of the tenant's requests at hand: enough for the free slots, so none waits unfetched."""
        while not self.rt.stopping.is_set():
            room = self._prefetch(ten) - len(ten.buffer)
            if room <= 0 or ten.pending <= len(ten.buffer) + ten.inflight:
                ten.want.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ten.want.wait(), 1.0)
                if room <= 0:
                    continue
            try:
                msgs = await ten.psub.fetch(max(1, room), timeout=0.5)
            except (TimeoutError, NatsTimeout):
                continue
            except Exception as e:
                log.warning("fetch for tenant %s failed: %s", ten.name, e)
                await self.rt.wait_stop(0.5)
                continue
            ten.buffer.extend(msgs)
            self._wake.set()

    def _prefetch(self, ten: Tenant) -> int:
        # At least one, so that demand reaches the autoscaler's activator path even with no workers.
        return max(1, self.pool.free_slots() + self.settings.worker_slots)

    # ------------------------------------------------------------------ scaling

    async def _on_ready(self, msg: Msg) -> None:
        try:
            ready = decode(msg.data, WorkerReady)
        except DecodeError:
            return
        cold_s = self.pool.mark_ready(ready.worker_id)
        if cold_s is not None:
            self.m_cold.observe(cold_s)
            self._wake.set()

    async def _scale_forever(self) -> None:
        while not self.rt.stopping.is_set():
            try:
                await self._discover()
                self._scale(time.monotonic())
            except Exception as e:
                log.warning("reward autoscaler tick failed: %s", e)
            self._publish_gauges()
            # Every tick, and as soon as an idle worker has waited out its keep-alive.
            self._scale_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._scale_wake.wait(), self.settings.tick_s)

    def _scale(self, now: float) -> None:
        live = self.pool.live()
        if self.settings.fixed_workers is not None:
            for _ in range(self.settings.fixed_workers - len(live)):
                self.pool.spawn()
            self.m_desired.set(self.settings.fixed_workers)
            return
        for ten in self.tenants.values():
            self.autoscaler.observe(now, ten.name, ten.pending)
        idle = {w.id: (now - w.idle_since if w.inflight == 0 and w.ready_at else None) for w in live}
        plan = self.autoscaler.plan(now, idle, self.pool.cold_start_s())
        self.m_desired.set(plan.decision.total)
        for _ in range(plan.spawn):
            self.pool.spawn()
        for wid in plan.retire:
            self.pool.retire(self.pool.workers[wid])
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "scale live=%d desired=%d now=%d spawn=%d retire=%d pending=%s",
                len(live),
                plan.decision.total,
                plan.decision.now,
                plan.spawn,
                len(plan.retire),
                {t.name: t.pending for t in self.tenants.values()},
            )

    def _publish_gauges(self) -> None:
        ws = list(self.pool.workers.values())
        self.m_workers.labels("starting").set(sum(w.ready_at is None for w in ws))
        self.m_workers.labels("ready").set(sum(w.ready for w in ws))
        self.m_workers.labels("retiring").set(sum(w.retiring for w in ws))
        self.m_worker_s.set(self.pool.worker_seconds())
        self.m_busy_s.set(self.pool.busy_seconds())
        for ten in self.tenants.values():
            self.m_pending.labels(ten.name).set(ten.pending)

    # ------------------------------------------------------------------ dispatch

    async def _dispatch_forever(self) -> None:
        while not self.rt.stopping.is_set():
            self._wake.clear()
            self._dispatch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)

    def _dispatch(self) -> None:
        while True:
            ready = [
                t.name for t in self.tenants.values() if t.buffer and t.inflight < self._tenant_cap(t.name)
            ]
            if not ready:
                break
            w = self.pool.least_loaded()
            if w is None:
                break
            ten = self.tenants[self.fair.pick(ready) or ready[0]]
            msg = ten.buffer.popleft()
            ten.want.set()
            est = self.fair.charge(ten.name)
            ten.inflight += 1
            w.inflight += 1
            self._spawn_task(self._run(ten, msg, w, est))

    def _tenant_cap(self, tenant: str) -> int:
        lim = self.autoscaler.limits_of(tenant)
        return 1 << 30 if lim.max_workers is None else lim.max_workers * self.settings.worker_slots

    async def _run(self, ten: Tenant, msg: Msg, w: Worker, est: float) -> None:
        t0 = time.monotonic()
        try:
            await self._deliver(ten, msg, w)
        except Exception as e:
            log.exception("reward request on %s failed in the controller", msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            self.m_redeliver.labels(type(e).__name__).inc()
        finally:
            ten.inflight -= 1
            w.inflight -= 1
            if w.inflight == 0:
                w.idle_since = time.monotonic()
                keepalive = self.pool.cold_start_s() + 0.005
                asyncio.get_running_loop().call_later(keepalive, self._scale_wake.set)
            self.fair.settle(ten.name, est, time.monotonic() - t0)
            self._wake.set()

    async def _deliver(self, ten: Tenant, msg: Msg, w: Worker) -> None:
        try:
            req = decode(msg.data, RewardRequest)
        except DecodeError as e:
            await self.rt.dead_letter(msg.subject, f"bad reward request: {e}", msg.data)
            await msg.term()
            self.m_scored.labels(ten.name, "bad_request").inc()
            return
        delivery = msg.metadata.num_delivered
        deadline = float(req.params.get("deadline_s", self.settings.deadline_s))
        assign = RewardAssign(msg.data, deadline)
        t0 = time.monotonic()
        reply = asyncio.ensure_future(
            self.rt.nc.request(subjects.reward_worker(w.id), encode(assign), timeout=deadline + KILL_GRACE_S)
        )
        died = asyncio.ensure_future(w.exited.wait())
        await asyncio.wait({reply, died}, return_when=asyncio.FIRST_COMPLETED)
        died.cancel()
        if not reply.done():
            reply.cancel()
            # The worker died holding the request: no fault of the request's, so it goes straight back.
            self.m_redeliver.labels("worker_died").inc()
            await msg.nak()
            return
        try:
            out = decode(reply.result().data, RewardOutcome)
        except (NatsTimeout, TimeoutError):
            log.warning("worker %s missed the %gs deadline on %s; killing it", w.id, deadline, msg.subject)
            self.pool.kill(w)
            out = RewardOutcome(False, w.busy_s, error=f"deadline of {deadline:g}s passed")
        except Exception as e:  # no responders: the worker is going away
            self.m_redeliver.labels("unreachable").inc()
            log.info("worker %s unreachable (%s); requeueing", w.id, e)
            await msg.nak()
            return
        w.busy_s = max(w.busy_s, out.busy_s)
        if out.ok:
            await msg.ack()
            if out.duplicate:
                self.m_dupes.inc()
            self.m_scored.labels(ten.name, "ok").inc()
            self.m_latency.labels(ten.name).observe(time.monotonic() - t0)
            return
        if out.retryable and delivery < self.settings.max_deliver:
            self.m_redeliver.labels("failed").inc()
            log.info("reward for %s failed (delivery %d): %s", req.trajectory.traj_id, delivery, out.error)
            await msg.nak(delay=min(2.0 ** (delivery - 1), 30.0))
            return
        await self._give_up(ten, msg, req, out.error, delivery)

    async def _give_up(self, ten: Tenant, msg: Msg, req: RewardRequest, error: str, delivery: int) -> None:
        reason = f"reward {req.kind!r} failed after {delivery} deliveries: {error}"
        log.warning("trajectory %s stored unscored: %s", req.trajectory.traj_id, reason)
        await self.rt.dead_letter(msg.subject, reason, msg.data)
        traj = req.trajectory
        traj = msgspec.structs.replace(traj, info={**traj.info, "reward_error": reason})
        await store(self.rt.js, self.kv_traj, self.rt.nc, traj, None)
        await msg.ack()
        self.m_scored.labels(ten.name, "gave_up").inc()

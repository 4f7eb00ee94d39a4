"""The trajectory-aware router: traj -> worker table, per-worker admission queues, forwarding, aborts.

Requests carry their caller's reply inbox; the router acknowledges them, keeps the queued ones alive with
keepalives, and forwards each to its worker when the worker has room. The worker answers the caller
directly, so a router that dies loses only its queue, and callers re-send once keepalives stop. One router
is active at a time (the ``router`` lease); others stand by to take over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from loom.policies.affinity import eligible
from loom.policies.migration import MigrationPlanner, Move
from loom.policies.ordering import OrderPolicy, RequestMeta, held, make_order
from loom.policies.placement import RoundRobinPlacement
from loom.policies.queueing import WorkerQueue
from loom.policies.routing import RouterView, RoutingPolicy, make_routing
from loom.protocol import (
    PLAN_KEY,
    PRESETS,
    AbortRequest,
    CancelJob,
    DecodeError,
    GenAccepted,
    GenKeepalive,
    GenRequest,
    Job,
    Placement,
    PriorityUpdate,
    ResolvedPolicy,
    TrajDone,
    TrajMeta,
    WorkerDone,
    WorkerInfo,
    WorkerLoad,
    decode,
    encode,
    subjects,
)
from loom.runtime.bus import kv_key, open_kv, through_failover
from loom.runtime.lease import Lease, LeaseLost, lease_bucket
from loom.runtime.service import Runtime
from loom.runtime.workers import WorkerRegistry
from services.router.settings import RouterSettings
from services.router.transfers import Transfers

log = logging.getLogger(__name__)

UNASSIGNED = ""
# Predictions that can tell a trajectory from its siblings. History-based estimates are per prompt, so the
# ranks they induce among a group's samples are noise; migrating on them moved KV back and forth and
# lengthened the demo job's makespan by 60-100% (384 s without migration, 619-770 s with it).
MIGRATING_METHODS = frozenset({"progressive", "prompt_only", "oracle"})


@dataclass
class Queued:
    req: GenRequest
    enqueued_at: float


@dataclass
class JobRouting:
    """Everything the router keeps per job: its policies and their state."""

    policy: ResolvedPolicy
    order: OrderPolicy
    # Per-request routing (non-static policies): one policy per set of workers a task tag may use.
    routings: dict[tuple[str, ...], RoutingPolicy] = field(default_factory=dict)
    planner: MigrationPlanner | None = None
    affinity: dict[str, str] | None = None


class Router:
    def __init__(self, rt: Runtime, settings: RouterSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.placement: dict[str, str] = {}  # "<job>.<traj>" -> worker
        # trajectory -> its PPS priority (``held``), and the estimate it was admitted with (its placement's)
        self.priorities: dict[str, float] = {}
        self.admitted: dict[str, float] = {}
        self.first_seen: dict[str, float] = {}  # trajectory -> arrival of its first request
        # trajectory -> (tokens generated, engine seconds, seconds waited) over its finished calls
        self.served: dict[str, tuple[float, float, float]] = {}
        self.jobs: dict[str, JobRouting] = {}
        self.workers: dict[str, WorkerInfo] = {}
        self.queues: dict[str, WorkerQueue[Queued]] = defaultdict(WorkerQueue)
        # rid -> the queue holding it, and trajectory -> its queued rids: a request or a re-prioritised
        # trajectory touches its own queue, not every worker's (256 of them made each call 0.2 ms dearer).
        self.queued_in: dict[str, str] = {}
        self.traj_queued: dict[str, set[str]] = defaultdict(set)
        self.forwarded: dict[str, dict[str, float]] = defaultdict(dict)  # worker -> rid -> wall time
        self.rid_worker: dict[str, str] = {}
        self.rid_req: dict[str, GenRequest] = {}
        self.rr = RoundRobinPlacement()
        self.transfers = Transfers(rt, self._apply_move)
        self.wake = asyncio.Event()
        self.active = False
        m = rt.metrics
        self.m_requests = m.counter("requests_total", "Generation requests received")
        self.m_forwarded = m.counter("forwarded_total", "Requests forwarded to workers", ["worker"])
        self.m_queue_wait = m.histogram("queue_wait_seconds", "Time queued in the router (wall)")
        self.m_queued = m.gauge("queued", "Requests waiting in the router", ["worker"])
        self.m_migrations = m.counter("reassignments_total", "Trajectories moved off a dead worker")

    # ------------------------------------------------------------------ lifecycle

    async def run(self, rt: Runtime) -> None:
        """Route once this instance holds the ``router`` lease (``loom.runtime.lease``); until then stand by, doing
        nothing. A standby that takes over starts as a restarted router does: callers re-send what the dead
        one had queued (their keepalives stopped), and what it had forwarded goes on at the workers, which
        drop a re-sent rid they already serve. One that loses the lease stops at once."""
        self.lease = Lease(await lease_bucket(rt.js), "router", rt.instance)
        # Serving once it stands by (another holds the lease), or, active, once its handlers are subscribed:
        # between taking the lease and subscribing, a request on the queue group finds no router.
        if not await self.lease.acquire(rt.stopping, standing_by=rt.mark_ready):
            return
        self.active = True
        log.info("router %s is active", rt.instance)
        try:
            await self._active(rt)
        except* LeaseLost as e:
            log.error("router %s stops: %s", rt.instance, e.exceptions[0])
            raise SystemExit(3) from None

    async def _active(self, rt: Runtime) -> None:
        # The lease is kept from the moment it is held: what the router opens and reads is read through the
        # streams' elections (a nats-server died), which can outlast the lease's ttl.
        registry: WorkerRegistry | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.lease.keep(rt.stopping))
                self.kv_traj = await open_kv(rt.js, subjects.KV_TRAJ)
                self.kv_jobs = await open_kv(rt.js, subjects.KV_JOBS)
                registry = self.registry = WorkerRegistry(rt.js, await open_kv(rt.js, subjects.KV_WORKERS))
                await through_failover(registry.start)
                self.workers = await through_failover(registry.live)
                await self._subscribe(rt)
                rt.mark_ready()
                tg.create_task(self._dispatch_forever())
                tg.create_task(self._keepalive_forever())
                tg.create_task(self._registry_forever())
                await rt.stopping.wait()
                self.wake.set()
        finally:
            if registry is not None:
                await registry.stop()
            await self.transfers.close()

    async def _subscribe(self, rt: Runtime) -> None:
        await rt.subscribe(subjects.GEN_REQUEST, GenRequest, self.on_gen, queue=subjects.QUEUE_GROUP)
        await rt.subscribe(subjects.GEN_ABORT, AbortRequest, self.on_abort)
        await rt.subscribe(subjects.CONTROL_CANCEL, CancelJob, self.on_cancel)
        await rt.subscribe(subjects.CONTROL_PRIORITY, PriorityUpdate, self.on_priority)
        await rt.subscribe(subjects.CONTROL_PLACEMENT, Placement, self.on_placement)
        await rt.subscribe(subjects.WORKER_DONE_ALL, WorkerDone, self.on_done)
        await rt.subscribe(subjects.TELEMETRY_WORKERS, WorkerLoad, self.on_load)
        await rt.subscribe(subjects.TRAJ_DONE_ALL, TrajDone, self.on_traj_done)

    def health(self) -> dict[str, Any]:
        if not self.active:
            return {"role": "standby"}
        return {
            "role": "active",
            "workers": sorted(self.workers),
            "queued": {w: len(q) for w, q in self.queues.items() if len(q)},
            "forwarded": {w: len(f) for w, f in self.forwarded.items() if f},
            "trajectories": len(self.placement),
            "migrations_pending": len(self.transfers.pending),
        }

    # ------------------------------------------------------------------ per-job policies

    async def _job(self, job_id: str) -> JobRouting:
        jr = self.jobs.get(job_id)
        if jr is not None:
            return jr
        policy = PRESETS["round_robin"]  # requests of a job the scheduler never stored
        affinity = None
        try:
            # Reads, so done again through a leader election (a timed-out read failed a trajectory).
            entry = await through_failover(lambda: self.kv_jobs.get(job_id))
            if entry.value:
                spec = decode(entry.value, Job).spec
                policy, affinity = spec.policy.resolved(), spec.hw_affinity
        except (KeyNotFoundError, DecodeError):
            pass
        jr = self.jobs.get(job_id)  # another request may have won the race while we awaited
        if jr is None:
            jr = self.jobs[job_id] = JobRouting(policy, make_order(policy.order), affinity=affinity)
            if policy.migration:
                await self._load_plan(job_id, jr)
        return jr

    async def _load_plan(self, job_id: str, jr: JobRouting) -> None:
        """A restarted router picks the migration plan up from KV."""
        try:
            entry = await through_failover(lambda: self.kv_traj.get(kv_key(job_id, PLAN_KEY)))
        except KeyNotFoundError:
            return
        if entry.value:
            self._plan(jr, decode(entry.value, Placement))

    def _plan(self, jr: JobRouting, p: Placement) -> None:
        if not (jr.policy.migration and p.groups):
            return
        jr.planner = MigrationPlanner(p.groups, p.sizes)
        for traj, w in p.assignments.items():
            jr.planner.add(kv_key(p.job_id, traj), p.predicted.get(traj, 0.0), w)

    # ------------------------------------------------------------------ requests

    async def on_gen(self, req: GenRequest, msg: Msg) -> None:
        if not msg.reply:
            await self.rt.reject(msg, "generation requests need a reply subject")
            return
        req.reply_to = msg.reply
        self.m_requests.inc()
        await self.rt.nc.publish(msg.reply, encode(GenAccepted(req.rid, self.rt.instance)))
        held_by = self.rid_worker.get(req.rid)
        if held_by is not None and held_by in self.workers:
            # A retry of a forwarded request: the worker dedupes it by rid and answers the new inbox.
            await self._forward(held_by, req)
            return
        if held_by is not None:
            self._forget(req.rid)
        if req.rid in self.queued_in:
            return
        jr = await self._job(req.job_id)
        worker = await self._route(req, jr)
        if req.step == 0:
            # A trajectory starts, or starts again (its environment manager went away): what an earlier run
            # of it was estimated to need no longer holds, only what it was admitted with.
            self._restart(kv_key(req.job_id, req.traj_id))
        meta = self._meta(req)
        req.priority = jr.order.engine_priority(meta)
        self.rid_req[req.rid] = req
        self._enqueue(worker, Queued(req, time.time()), jr, meta)
        self.wake.set()

    def _enqueue(self, worker: str, q: Queued, jr: JobRouting, meta: RequestMeta | None = None) -> None:
        req = q.req
        self.queues[worker].push(req.job_id, req.rid, q, meta or self._meta(req), jr.order)
        self.queued_in[req.rid] = worker
        self.traj_queued[kv_key(req.job_id, req.traj_id)].add(req.rid)

    def _dequeued(self, req: GenRequest) -> None:
        """Index upkeep once ``req`` has left its queue (popped or removed)."""
        self.queued_in.pop(req.rid, None)
        key = kv_key(req.job_id, req.traj_id)
        rids = self.traj_queued.get(key)
        if rids is not None:
            rids.discard(req.rid)
            if not rids:
                del self.traj_queued[key]

    def _meta(self, req: GenRequest) -> RequestMeta:
        key = kv_key(req.job_id, req.traj_id)
        now = time.time()
        first = self.first_seen.setdefault(key, now)
        prio = self.priorities.get(key, req.priority)
        done = self.served.get(key, (0.0, 0.0, 0.0))
        return RequestMeta(
            traj=key,
            step=req.step,
            priority=prio,
            traj_arrival=first,
            arrival=now,
            attained=done[0],
            attained_s=done[1],
            waited=done[2],
        )

    def _eligible(self, jr: JobRouting, tag: str) -> list[str]:
        """The live workers a request of ``tag`` may run on under its job's hardware affinity."""
        names = sorted(self.workers)
        if not jr.affinity:
            return names
        return [names[i] for i in eligible([self.workers[n].gpu for n in names], jr.affinity, tag)]

    async def _route(self, req: GenRequest, jr: JobRouting) -> str:
        if jr.policy.static or not self.workers:
            return await self._worker_for(req, jr)
        key = kv_key(req.job_id, req.traj_id)
        names = tuple(self._eligible(jr, req.tag))
        routing = jr.routings.get(names)
        if routing is None:
            seed = hash(req.job_id) & 0xFFFF
            routing = jr.routings[names] = make_routing(jr.policy.placement, list(names), seed=seed)
        load = self._load()
        w = routing.choose(key, req.input_len, RouterView(names, {n: load[n] for n in names}))
        self.placement[key] = w
        return w

    async def _worker_for(self, req: GenRequest, jr: JobRouting) -> str:
        key = kv_key(req.job_id, req.traj_id)
        w = self.placement.get(key)
        if w is None:
            try:
                entry = await through_failover(lambda: self.kv_traj.get(key))
                if entry.value:
                    w = decode(entry.value, TrajMeta).worker_id
            except (KeyNotFoundError, DecodeError):
                w = None
        if w is not None and w in self.workers:
            self.placement[key] = w
            return w
        if not self.workers:
            return UNASSIGNED
        new = self.rr.place_one(key, self._eligible(jr, req.tag), self._load())
        if w is not None:
            self.m_migrations.inc()
            log.info("trajectory %s moves from %s to %s", key, w, new)
        self.placement[key] = new
        meta = TrajMeta(job_id=req.job_id, traj_id=req.traj_id, worker_id=new, state="running")
        await self.kv_traj.put(key, encode(meta))
        return new

    def _load(self) -> dict[str, int]:
        return {w: len(self.queues[w]) + len(self.forwarded[w]) for w in self.workers}

    async def _forward(self, worker: str, req: GenRequest) -> None:
        self.forwarded[worker][req.rid] = time.time()
        self.rid_worker[req.rid] = worker
        self.rid_req[req.rid] = req
        await self.rt.nc.publish(subjects.worker_gen(worker), encode(req))
        self.m_forwarded.labels(worker).inc()

    def _forget(self, rid: str) -> None:
        w = self.rid_worker.pop(rid, None)
        if w is not None:
            self.forwarded[w].pop(rid, None)
        self.rid_req.pop(rid, None)

    async def _dispatch_forever(self) -> None:
        while not self.rt.stopping.is_set():
            await self.wake.wait()
            self.wake.clear()
            await self._dispatch()

    async def _dispatch(self) -> None:
        if self.workers and len(self.queues[UNASSIGNED]):
            while (item := self.queues[UNASSIGNED].pop()) is not None:
                _, queued = item
                self._dequeued(queued.req)
                jr = await self._job(queued.req.job_id)
                self._enqueue(await self._route(queued.req, jr), queued, jr)
        # Only workers with something queued: the rest have nothing to send, however much room they have.
        for w in [w for w, q in self.queues.items() if len(q) and w in self.workers]:
            queue = self.queues[w]
            room = self.workers[w].max_running + self.settings.overcommit - len(self.forwarded[w])
            while room > 0 and (item := queue.pop()) is not None:
                _, queued = item
                self._dequeued(queued.req)
                self.m_queue_wait.observe(time.time() - queued.enqueued_at)
                await self._forward(w, queued.req)
                room -= 1

    async def _keepalive_forever(self) -> None:
        while not self.rt.stopping.is_set():
            self._age_orders()
            # Gauges once a tick, not once a dispatch: setting 256 labelled gauges per call cost more than
            # the routing itself.
            for w, wq in self.queues.items():
                self.m_queued.labels(w or "unassigned").set(len(wq))
            for q in list(self.queues.values()):
                for rid, item in q.items():
                    ka = GenKeepalive(rid, self.rt.instance, "queued")
                    await self.rt.nc.publish(item.req.reply_to, encode(ka))
            await self.rt.wait_stop(self.settings.keepalive_s)

    def _age_orders(self) -> None:
        """Orders whose keys depend on waiting time (Autellix's anti-starvation) are re-keyed as time passes."""
        now = time.time()
        aging = {j for j, jr in self.jobs.items() if hasattr(jr.order, "now")}
        for j in aging:
            self.jobs[j].order.now = now  # type: ignore[attr-defined]
        for wq in self.queues.values():
            for j in aging & set(wq.jobs):
                wq.jobs[j].rekey_all()

    # ------------------------------------------------------------------ workers

    async def on_done(self, done: WorkerDone, _msg: Msg) -> None:
        req = self.rid_req.get(done.rid)
        if req is not None:
            key = kv_key(req.job_id, req.traj_id)
            tok, sec, wait = self.served.get(key, (0.0, 0.0, 0.0))
            self.served[key] = (tok + done.output_len, sec + done.engine_s, wait + done.queue_s)
        self._forget(done.rid)
        self.wake.set()

    async def on_load(self, load: WorkerLoad, _msg: Msg) -> None:
        # The worker's own list of requests is the truth; keep only our very recent forwards on top of it
        # (they may not have reached the worker when it took the snapshot). Rebuilds state after a restart.
        fw = self.forwarded[load.worker_id]
        recent = {rid: t for rid, t in fw.items() if t > load.at - 2.0}
        now = time.time()
        self.forwarded[load.worker_id] = {rid: fw.get(rid, now) for rid in load.rids} | recent
        for rid in load.rids:
            self.rid_worker.setdefault(rid, load.worker_id)
        self.wake.set()

    async def _registry_forever(self) -> None:
        while not self.rt.stopping.is_set():
            try:
                workers = await self.registry.live()
            except Exception as e:
                log.warning("worker registry unreadable: %s", e)
                workers = self.workers
            gone = set(self.workers) - set(workers)
            self.workers = workers
            for w in gone:
                log.warning("worker %s is gone; requeueing its %d queued requests", w, len(self.queues[w]))
                for rid, q in self.queues[w].items():
                    self.queues[w].remove(rid)
                    self._dequeued(q.req)
                    self.placement.pop(kv_key(q.req.job_id, q.req.traj_id), None)
                    self._enqueue(UNASSIGNED, q, await self._job(q.req.job_id))
                for rid in list(self.forwarded[w]):
                    self._forget(rid)
            if gone or workers:
                self.wake.set()
            await self.rt.wait_stop(self.settings.registry_s)

    # ------------------------------------------------------------------ control

    def _matches(self, req: GenRequest, a: AbortRequest) -> bool:
        if a.rid is not None:
            return req.rid == a.rid
        if a.job_id is not None and req.job_id != a.job_id:
            return False
        return a.traj_id is None or req.traj_id == a.traj_id

    async def on_abort(self, a: AbortRequest, _msg: Msg) -> None:
        if a.rid is None and a.job_id is None and a.traj_id is None:
            return
        held = self.queued_in.get(a.rid) if a.rid is not None else None
        queues = (
            list(self.queues.values()) if a.rid is None else [self.queues[held]] if held is not None else []
        )
        for wq in queues:
            for rid, item in wq.items():
                if self._matches(item.req, a):
                    wq.remove(rid)
                    self._dequeued(item.req)
                    self.rid_req.pop(rid, None)
        targets = {
            self.rid_worker[r]
            for r, req in self.rid_req.items()
            if r in self.rid_worker and self._matches(req, a)
        }
        if a.rid is None:
            targets |= set(self.workers)  # a job or trajectory may have requests we never saw (restart)
        for w in targets:
            await self.rt.nc.publish(subjects.worker_abort(w), encode(a))

    def _per_trajectory(self) -> tuple[dict[str, Any], ...]:
        """What the router keeps per trajectory: dropped when it ends or its job is cancelled."""
        return (self.placement, self.priorities, self.admitted, self.first_seen, self.served)

    def _restart(self, key: str) -> None:
        admitted = self.admitted.get(key)
        if admitted is None:
            self.priorities.pop(key, None)
        else:
            self.priorities[key] = admitted

    async def on_cancel(self, c: CancelJob, msg: Msg) -> None:
        await self.on_abort(AbortRequest(job_id=c.job_id), msg)
        prefix = c.job_id + "."
        for index in self._per_trajectory():
            for key in [k for k in index if k.startswith(prefix)]:
                del index[key]
        self.transfers.forget_job(c.job_id)
        self.jobs.pop(c.job_id, None)

    async def on_priority(self, p: PriorityUpdate, _msg: Msg) -> None:
        key = kv_key(p.job_id, p.traj_id)
        prio = self.priorities[key] = held(self.priorities.get(key), p.priority)
        for w in {self.queued_in[rid] for rid in self.traj_queued.get(key, ())}:
            self.queues[w].reprioritize(p.job_id, key, prio)
        jr = await self._job(p.job_id)
        if jr.planner is None or key not in jr.planner.where:
            return
        if p.method not in MIGRATING_METHODS:
            return
        # Ranked by predicted length, as the plan was (Heddle §5.3): a move corrects a prediction error.
        # Ranking by remaining work instead churns: it shrinks as every trajectory progresses (an exact
        # predictor then made 1,655 moves among 400 trajectories in the harness).
        remaining = p.predicted_remaining if p.predicted_remaining is not None else p.priority
        move = jr.planner.update(key, p.generated_tokens + remaining)
        if move is not None and move.dst in self.workers:
            await self.transfers.submit(move, p.context_len)

    async def _apply_move(self, mv: Move) -> bool:
        """The trajectory's next step goes to the target from now on; the warm-up races its tool call."""
        job_id, traj_id = mv.traj.split(".", 1)
        jr = self.jobs.get(job_id)
        if jr is None or jr.planner is None or mv.dst not in self.workers:
            return False
        self.placement[mv.traj] = mv.dst
        jr.planner.moved(mv.traj, mv.dst)
        meta = TrajMeta(job_id=job_id, traj_id=traj_id, worker_id=mv.dst, state="running")
        await self.kv_traj.put(mv.traj, encode(meta))
        log.info("migrating %s from %s to %s (predicted %.0f tokens)", mv.traj, mv.src, mv.dst, mv.length)
        return True

    async def on_placement(self, p: Placement, _msg: Msg) -> None:
        for traj, w in p.assignments.items():
            key = kv_key(p.job_id, traj)
            self.placement[key] = w
            if traj in p.predicted:
                # Its first call is ranked by the estimate it was placed by, as every later one is by the
                # longest since (Algorithm 1, line 3).
                self.admitted[key] = p.predicted[traj]
                self.priorities[key] = held(self.priorities.get(key), p.predicted[traj])
        jr = await self._job(p.job_id)
        if jr.planner is None:
            self._plan(jr, p)

    async def on_traj_done(self, ev: TrajDone, _msg: Msg) -> None:
        key = kv_key(ev.job_id, ev.traj_id)
        for index in self._per_trajectory():
            index.pop(key, None)
        self.transfers.forget(key)
        jr = self.jobs.get(ev.job_id)
        if jr is not None:
            if jr.planner is not None:
                jr.planner.finish(key)
            for routing in jr.routings.values():
                routing.forget(key)

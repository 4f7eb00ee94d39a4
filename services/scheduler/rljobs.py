"""Co-scheduled RL jobs (RollMux): registration, group placement by Algorithm 1, and phase permits.

Trainer processes ask for a phase on ``loom.v1.rollmux.request`` and report it done on
``loom.v1.rollmux.done``; each group's round-robin executor decides who runs, and permits go out on
``loom.v1.rollmux.permit.<job>``. A rollout that reports 80% of its responses done on
``loom.v1.rollmux.progress`` is told to consolidate its tail (``loom.v1.rollmux.migrate.<job>``) and the
next rollout starts on the freed GPUs. Registrations are kept in KV and replayed in order after a restart
(the plan is recomputed; trainers whose permits were in flight ask again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.intergroup import CoScheduler, RollMux
from loom.policies.rollmux.job import RLJob
from loom.policies.rollmux.roundrobin import Permit, RoundRobinExecutor
from loom.protocol import (
    ErrorReply,
    PhaseAck,
    PhaseDone,
    PhasePermit,
    PhaseProgress,
    PhaseRequest,
    RLJobPlacement,
    RLJobRecord,
    RLJobSpec,
    TailMigration,
    decode,
    encode,
    subjects,
)
from loom.runtime.bus import kv_values, open_kv
from loom.runtime.service import Runtime

log = logging.getLogger(__name__)


class RLJobExists(ValueError):
    pass


class RLJobManager:
    def __init__(self, rt: Runtime, cluster: ClusterSpec, tail_threshold: float = 0.8) -> None:
        self.rt = rt
        self.cluster = cluster
        self.tail_threshold = tail_threshold
        self.state = CoScheduler(cluster, RollMux())
        self.executors: dict[int, RoundRobinExecutor] = {}
        self.placements: dict[str, RLJobPlacement] = {}
        m = rt.metrics
        self.m_permits = m.counter("rollmux_permits_total", "Phase permits granted")
        self.m_migrations = m.counter("rollmux_tail_migrations_total", "Rollout tails consolidated")
        self.m_cost = m.gauge("rollmux_cost_per_hour", "Provisioning cost of the co-scheduled groups ($/h)")

    async def start(self) -> None:
        # Read through the elections a standby may take over during (``jobs.JobManager.start``).
        self.kv = await open_kv(self.rt.js, subjects.KV_RLJOBS)
        records = [decode(v, RLJobRecord) for v in await kv_values(self.rt.js, self.kv, subjects.KV_RLJOBS)]
        for r in sorted(records, key=lambda r: r.created_at):
            self._place(r.spec, r.created_at)
        if records:
            log.info("replayed %d co-scheduled RL jobs into %d groups", len(records), len(self.state.groups))
        await self.rt.subscribe(subjects.PHASE_REQUEST, PhaseRequest, self._on_request)
        await self.rt.subscribe(subjects.PHASE_DONE, PhaseDone, self._on_done)
        await self.rt.subscribe(subjects.PHASE_PROGRESS, PhaseProgress, self._on_progress)

    # ---------------------------------------------------------------- registration (REST)

    async def register(self, spec: RLJobSpec) -> RLJobPlacement:
        if spec.name in self.placements:
            raise RLJobExists(f"RL job {spec.name!r} is already registered")
        created = time.time()
        placement = self._place(spec, created)
        await self.kv.put(spec.name, encode(RLJobRecord(spec, created)))
        return placement

    async def remove(self, name: str) -> RLJobPlacement:
        placement = self.placements.pop(name)
        gid = self.state.where[name]
        permits = self.executors[gid].remove(name)
        if not self.state.depart(name).members:
            del self.executors[gid]
        await self.kv.delete(name)
        await self._publish(gid, permits)
        self.m_cost.set(self.state.cost())
        return placement

    def _place(self, spec: RLJobSpec, created: float) -> RLJobPlacement:
        job = RLJob(
            spec.name,
            spec.model,
            spec.rollout_s,
            spec.train_s,
            spec.slo,
            spec.rollout_nodes,
            spec.train_nodes,
        )
        d = self.state.submit(job)
        g = self.state.groups[self.state.where[job.id]]
        ex = self.executors.setdefault(
            g.id, RoundRobinExecutor(self.cluster.gpus_per_node, self.tail_threshold)
        )
        ex.add(job.id, g.members[job.id].nodes)
        placement = RLJobPlacement(
            job.id, g.id, list(g.members[job.id].nodes), g.train_nodes, d.strategy, d.period, d.delta, created
        )
        self.placements[job.id] = placement
        self.m_cost.set(self.state.cost())
        return placement

    def groups(self) -> list[dict[str, Any]]:
        return [
            {
                "group": g.id,
                "jobs": list(g.members),
                "rollout_nodes": {str(n): js for n, js in g.nodes.items()},
                "train_nodes": g.train_nodes,
                "cost_per_hour": round(g.cost(), 2),
                "period_s": round(g.period(), 3),
                "longest_solo_s": round(g.t_cycle, 3),
                "saturated": g.saturated(),
            }
            for g in self.state.groups.values()
        ]

    def health(self) -> dict[str, Any]:
        return {"rljobs": len(self.placements), "rljob_groups": len(self.state.groups)}

    # ---------------------------------------------------------------- phase permits (NATS)

    async def _step(
        self, job: str, act: Callable[[RoundRobinExecutor], list[Permit]]
    ) -> list[Permit] | ErrorReply:
        """Apply one phase event to the job's group executor and publish the permits it frees."""
        gid = self.state.where.get(job)
        if gid is None:
            return ErrorReply("not_found", f"unknown RL job {job!r}; register it with POST /v1/rljobs")
        try:
            permits = act(self.executors[gid])
        except ValueError as e:
            return ErrorReply("conflict", str(e))
        await self._publish(gid, permits)
        return permits

    async def _on_request(self, req: PhaseRequest, _msg: Msg) -> PhaseAck | ErrorReply:
        out = await self._step(req.job, lambda ex: ex.request(req.job, req.phase))
        return out if isinstance(out, ErrorReply) else PhaseAck(any(p.job == req.job for p in out))

    async def _on_done(self, done: PhaseDone, _msg: Msg) -> PhaseAck | ErrorReply:
        out = await self._step(done.job, lambda ex: ex.done(done.job, done.phase))
        return out if isinstance(out, ErrorReply) else PhaseAck(True)

    async def _on_progress(self, p: PhaseProgress, _msg: Msg) -> None:
        gid = self.state.where.get(p.job)
        if gid is None:
            return
        migration, permits = self.executors[gid].progress(p.job, p.done_fraction)
        if migration is not None:
            self.m_migrations.inc()
            tail = TailMigration(migration.job, migration.node, migration.gpus, time.time())
            await self.rt.nc.publish(subjects.tail_migration(p.job), encode(tail))
        await self._publish(gid, permits)

    async def _publish(self, gid: int, permits: list[Permit]) -> None:
        for pm in permits:
            self.m_permits.inc()
            msg = PhasePermit(pm.job, pm.phase, gid, list(pm.nodes), dict(pm.gpus))  # type: ignore[arg-type]
            await self.rt.nc.publish(subjects.phase_permit(pm.job), encode(msg))

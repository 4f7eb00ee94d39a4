"""The live dashboard's data: what the scheduler hears on the bus, kept in bounded windows, as one snapshot.

- jobs and rollout streams with their progress (the scheduler's own records);
- each worker's load (its telemetry: running and waiting requests, KV in use) and generated tokens per
  second, summed into the fleet's throughput;
- a Gantt of model calls per worker: each call the workers report done, from when it was queued at the
  engine to when it ended (simulated seconds), tagged with its job and trajectory;
- predicted against actual lengths: a trajectory's first prediction with its first tool call, and the
  tokens it generated in the end;
- reward workers and autoscaling (the reward service's health), and RollMux groups (the admin's).

A browser opens it with ``/ui?token=...``: the token is checked once and swapped for a session cookie
(``BrowserSessions``), so it leaves the address bar; the page then listens to ``/ui/events``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.msg import Msg

from loom.identity.auth import Principal
from loom.protocol import (
    Health,
    PriorityUpdate,
    TrajDone,
    WorkerDone,
    WorkerLoad,
    decode,
    subjects,
    to_builtins,
)
from loom.runtime.service import Runtime
from services.scheduler.jobs import JobManager
from services.scheduler.rljobs import RLJobManager
from services.scheduler.streams import StreamManager

GANTT_S = 120.0  # simulated seconds of model calls the Gantt shows
MAX_CALLS = 5000
MAX_POINTS = 2000
MAX_JOBS = 50
THROUGHPUT_POINTS = 300
SILENT_S = 10.0  # wall seconds without telemetry after which a worker is gone


class BrowserSessions:
    """Cookie sessions of browsers that opened ``/ui?token=...``: a random key per browser, for a while."""

    COOKIE = "loom_ui"

    def __init__(self, ttl_s: float = 12 * 3600, limit: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._by_key: OrderedDict[str, tuple[Principal, float]] = OrderedDict()

    def open(self, who: Principal) -> str:
        key = secrets.token_urlsafe(32)
        self._by_key[key] = (who, time.monotonic() + self.ttl_s)
        while len(self._by_key) > self.limit:
            self._by_key.popitem(last=False)
        return key

    def who(self, key: str | None) -> Principal | None:
        found = self._by_key.get(key or "")
        if found is None:
            return None
        if found[1] < time.monotonic():
            del self._by_key[key or ""]
            return None
        return found[0]


class Dashboard:
    def __init__(self, rt: Runtime, jobs: JobManager, streams: StreamManager, rljobs: RLJobManager) -> None:
        self.rt = rt
        self.jobs = jobs
        self.streams = streams
        self.rljobs = rljobs
        self.calls: deque[tuple[str, str, str, int, float, float, float]] = deque(maxlen=MAX_CALLS)
        self.loads: dict[str, WorkerLoad] = {}
        self._heard: dict[str, float] = {}  # wall time of each worker's last telemetry
        self.rates: dict[str, float] = {}
        self._last: dict[str, tuple[float, int]] = {}
        self.throughput: deque[tuple[float, float]] = deque(maxlen=THROUGHPUT_POINTS)
        self._first_prediction: OrderedDict[str, float] = OrderedDict()
        self.lengths: deque[tuple[str, float, int]] = deque(maxlen=MAX_POINTS)
        self.reward: dict[str, Any] | None = None

    async def start(self) -> None:
        await self.rt.subscribe(subjects.TELEMETRY_WORKERS, WorkerLoad, self._on_load)
        await self.rt.subscribe(subjects.WORKER_DONE_ALL, WorkerDone, self._on_call)
        await self.rt.subscribe(subjects.CONTROL_PRIORITY, PriorityUpdate, self._on_prediction)
        await self.rt.subscribe(subjects.TRAJ_DONE_ALL, TrajDone, self._on_done)

    async def _on_load(self, load: WorkerLoad, _: Msg) -> None:
        prev = self._last.get(load.worker_id)
        self._last[load.worker_id] = (load.at, load.generated_tokens)
        self.loads[load.worker_id] = load
        self._heard[load.worker_id] = time.monotonic()
        if prev is not None and load.at > prev[0]:
            self.rates[load.worker_id] = max(0.0, (load.generated_tokens - prev[1]) / (load.at - prev[0]))
        self._forget_silent()
        now = self.rt.clock.now()
        if not self.throughput or now - self.throughput[-1][0] >= 1.0:
            self.throughput.append((now, sum(self.rates.values())))

    def _forget_silent(self) -> None:
        """Workers gone quiet (removed, crashed) leave the table and the fleet's throughput."""
        cutoff = time.monotonic() - SILENT_S
        for w in [w for w, t in self._heard.items() if t < cutoff]:
            for d in (self.loads, self.rates, self._last, self._heard):
                d.pop(w, None)

    async def _on_call(self, done: WorkerDone, _: Msg) -> None:
        parts = done.rid.split(".")
        if len(parts) != 3 or not parts[2].isdigit():
            return  # a warm-up or a request from outside a trajectory
        end = self.rt.clock.now()
        gen_start = end - done.engine_s
        self.calls.append(
            (done.worker_id, parts[0], parts[1], int(parts[2]), gen_start - done.queue_s, gen_start, end)
        )

    async def _on_prediction(self, upd: PriorityUpdate, _: Msg) -> None:
        key = f"{upd.job_id}.{upd.traj_id}"
        if key not in self._first_prediction:
            self._first_prediction[key] = upd.priority
            while len(self._first_prediction) > 4 * MAX_POINTS:
                self._first_prediction.popitem(last=False)

    async def _on_done(self, ev: TrajDone, _: Msg) -> None:
        predicted = self._first_prediction.pop(f"{ev.job_id}.{ev.traj_id}", None)
        if predicted is not None and ev.status == "completed":
            self.lengths.append((ev.job_id, predicted, ev.output_tokens))

    async def poll_reward_forever(self, period_s: float = 2.0) -> None:
        while not self.rt.stopping.is_set():
            try:
                msg = await self.rt.nc.request(subjects.health("reward"), b"", timeout=1.0)
                h = decode(msg.data, Health)
                self.reward = {"instance": h.instance, "ok": h.ok, **h.details}
            except Exception:
                self.reward = None
            await self.rt.wait_stop(period_s)

    def _reward_for(self, who: Principal) -> dict[str, Any] | None:
        """The reward service's health; a tenant sees its own queue, not the others'."""
        if self.reward is None or who.admin:
            return self.reward
        tenants = self.reward.get("tenants") or {}
        return {**self.reward, "tenants": {who.tenant: tenants[who.tenant]} if who.tenant in tenants else {}}

    def snapshot(self, who: Principal) -> dict[str, Any]:
        self._forget_silent()
        now = self.rt.clock.now()
        mine = [j for j in self.jobs.jobs.values() if who.owns(j.spec.tenant)]
        mine.sort(key=lambda j: j.created_at, reverse=True)
        jobs = [
            {
                "id": j.id,
                "name": j.spec.name,
                "kind": j.kind,
                "env": j.spec.env,
                "tenant": j.spec.tenant,
                "state": j.state,
                "n": j.n_trajectories,
                "completed": j.completed,
                "failed": j.failed,
            }
            for j in mine[:MAX_JOBS]
        ]
        streams = [
            {
                "id": s.id,
                "name": s.spec.name,
                "state": s.state,
                "version": s.version,
                "delivered": s.delivered,
                "open_groups": len(s.open),
                "stale_groups": s.stale_groups,
            }
            for s in self.streams.streams.values()
            if who.owns(s.spec.tenant)
        ]
        visible = {j.id for j in mine}
        t0 = now - GANTT_S
        calls = [
            [w, job, traj, step, round(q, 3), round(g, 3), round(e, 3)]
            for w, job, traj, step, q, g, e in self.calls
            if e >= t0 and job in visible
        ]
        workers = [
            {
                "id": w,
                "running": ld.running,
                "waiting": ld.waiting,
                "kv_used": ld.kv_used_tokens,
                "kv_capacity": ld.kv_capacity_tokens,
                "tokens_per_s": round(self.rates.get(w, 0.0), 1),
            }
            for w, ld in sorted(self.loads.items())
        ]
        return {
            "now": round(now, 3),
            "tenant": "admin" if who.admin else who.tenant,
            "jobs": jobs,
            "streams": streams,
            "workers": workers,
            "gantt": {"from": round(t0, 3), "to": round(now, 3), "calls": calls},
            "throughput": [[round(t, 2), round(r, 1)] for t, r in self.throughput],
            "lengths": [[round(p), a] for job, p, a in self.lengths if job in visible],
            "reward": self._reward_for(who),
            "rollmux": to_builtins(self.rljobs.groups()) if who.admin else None,
        }

    async def events(self, who: Principal, period_s: float = 1.0) -> AsyncIterator[bytes]:
        """Server-sent events: a snapshot now and every ``period_s``."""
        while not self.rt.stopping.is_set():
            yield b"data: " + json.dumps(self.snapshot(who)).encode() + b"\n\n"
            await asyncio.sleep(period_s)

"""``loom bench fleet``: Loom's control plane at fleet scale.

The real services (scheduler, router, predictor, environment manager, reward) run as processes over a real
NATS, with the users and permissions ``loom up`` gives them, beside hundreds of simulated rollout workers,
several per process (``python -m services.rollout.fleet``), at a high simulated-time speed-up: an engine's
call takes milliseconds of wall time, so what limits the calls carried is the control plane, not the GPUs.
One job replays the coding traces (``swe-replay``, Heddle's policy, no Docker and no model) with at least
20,000 trajectories in the full run, each cut at ``--turns`` calls. The same run goes twice: on one
nats-server, the baseline, and on a three-server NATS cluster with every stream and bucket replicated
three times (``LOOM_JS_REPLICAS=3``), reported with the ratios between them.

What it reports (the cluster's figures at the top level when it ran, each run's under its name):

- ``calls_per_s``: model calls completed per wall second while the job's calls flow steadily (its middle
  80%, from the router's request counter); ``calls_per_s_job`` over the whole job, submission to last result.
- ``router_overhead_ms`` (p50, p99): what the router adds to a call. A probe sends a one-token generation
  through the router and, right after, the same call straight to the worker the router chose, as the router
  would forward it; the overhead is the routed call's latency less the direct one's (paired, both timed
  from publish to result, the workers having free slots, so nothing waits for a GPU), during the job.
- ``intake_traj_per_s``: trajectories per second from the job's submission to the scheduler having planned,
  recorded and queued all of them on the work stream (the job turning ``running``).
- ``cpu_s_per_1k_calls``: CPU seconds (user + system, from ``/proc``, each service's process tree: the
  reward service's worker processes count as the reward service's) per 1,000 calls over the job, for every
  service, the worker fleet (``rollout``) and NATS; ``cores``: the same as cores busy. Each service is one
  asyncio loop, so its own process can use one core at most: ``capacity_calls_per_s`` is the calls it would
  carry at a full core (calls over its own process's CPU seconds), ``saturates_first`` the service with
  the fewest, and ``saturates_first_unsharded`` the one of those that run a single active instance (the
  scheduler and the router; the others share their work by queue groups and scale out).
- ``max_gpus_served``: the largest fleet of single-GPU workers one router serves at the Heddle workloads'
  call rates. The router costs CPU per call and, apart from any call, per worker: each worker's telemetry
  (twice a second), heartbeat and registry entry. The fleet is started one process at a time and the
  router's idle cores are measured after each (``router_idle_sweep``); fitted as workers^k, that says where
  the fleet alone fills a core (``max_gpus_idle_only``). One router core carries ``router_calls_per_core_s``
  calls (1 over its CPU seconds per call over the job, everything it did meanwhile charged to the calls),
  and one GPU issues ``r`` calls per second: each Heddle workload on 8 H100 (Qwen3-14B, Heddle's policy) on
  the calibrated engine in virtual time (``loom.bench.harness``), its calls in the busiest tenth of its makespan
  (``call_rates``). A workload's limit is the lesser of calls-per-core / ``r`` and the idle-only fleet;
  ``max_gpus_served`` is that of the most call-intensive workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from loom.bench.machine import machine, median_run, spread
from loom.bench.registry import Benchmark
from loom.data.traces import load_traces
from loom.identity import nats_auth
from loom.identity.auth import header, new_token
from loom.protocol import (
    PRESETS,
    DecodeError,
    ErrorReply,
    GenEvent,
    GenRequest,
    GenResult,
    decode_union,
    encode,
    subjects,
)
from loom.runtime import bus
from loom.runtime.healthcheck import gather
from loom.runtime.lifecycle import free_port
from loom.runtime.natsserver import NatsCluster, NatsServer, NatsServerError, find_binary
from loom.runtime.supervisor import ProcSpec, Supervisor

SERVICES = ("scheduler", "router", "predictor", "envmgr", "reward")
# Every process a figure is kept for: the services, the worker fleet's processes and the nats-servers.
PARTS = (*SERVICES, "rollout", "nats")
WORKLOADS = ("coding", "search", "tool_use")
PROBE_JOB = "fleet-probe"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None, help="simulated rollout workers (256; quick 32)")
    p.add_argument("--per-process", type=int, default=64, help="workers per fleet process (64)")
    p.add_argument(
        "--trajectories", type=int, default=None, help="trajectories of the job (20,000; quick 1,000)"
    )
    p.add_argument("--turns", type=int, default=3, help="model calls per trajectory at most (3)")
    p.add_argument("--speed", type=float, default=1000.0, help="simulated-time speed-up (1000)")
    p.add_argument(
        "--nats",
        choices=["both", "single", "cluster"],
        default=None,
        help="one nats-server, a 3-server cluster, or both (both; quick single)",
    )
    p.add_argument("--policy", choices=sorted(PRESETS), default="heddle", help="the job's policy (heddle)")
    p.add_argument(
        "--shared-connection", action="store_true", help="a fleet process's workers share one NATS connection"
    )
    p.add_argument("--probe-hz", type=float, default=10.0, help="router probes per second (10)")
    p.add_argument(
        "--keep", default=None, help="keep each run's home (logs, NATS store) under this directory"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs of each NATS mode, each on a fresh stack (3; quick 1): the median run is reported, every"
        " headline figure's median, range and spread beside it",
    )


# ---------------------------------------------------------------------------------------------- processes


def _clock_ticks() -> int:
    return int(os.sysconf("SC_CLK_TCK"))


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, clock ticks of the process itself, of the children it has reaped); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the name: state, ppid, ..., utime, stime, cutime, cstime (fields 14 to 17 of proc(5)).
    own = int(fields[11]) + int(fields[12])
    return int(fields[1]), own, int(fields[13]) + int(fields[14])


ProcTable = tuple[dict[int, int], dict[int, tuple[int, int]]]


def proc_table() -> ProcTable:
    """Every process's parent and (own, reaped children's) clock ticks, read from /proc once."""
    parents: dict[int, int] = {}
    ticks: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None:
            ppid, own, reaped = st
            parents[int(entry)], ticks[int(entry)] = ppid, (own, reaped)
    return parents, ticks


def tree_cpu(roots: list[int], table: ProcTable | None = None) -> tuple[float, float]:
    """CPU seconds (user + system) of the processes ``roots`` themselves, and of them with all their
    descendants, the children they have reaped included (the reward service's workers come and go)."""
    parents, ticks = table or proc_table()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    own = sum(ticks.get(pid, (0, 0))[0] for pid in roots)
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        total += sum(ticks.get(pid, (0, 0)))
        todo.extend(children.get(pid, []))
    hz = _clock_ticks()
    return own / hz, total / hz


class CpuMeter:
    """CPU seconds per part from a start, sampled: a process restarted meanwhile keeps what it used up to
    its last sample (the supervisor reaps it, so /proc forgets it), and its successor counts from its first."""

    def __init__(self, pids: Callable[[], dict[str, list[int]]]) -> None:
        self.pids = pids
        self.first: dict[tuple[str, int], tuple[float, float]] = {}
        self.last: dict[tuple[str, int], tuple[float, float]] = {}

    def sample(self) -> None:
        table = proc_table()
        for part, pids in self.pids().items():
            for pid in pids:
                if pid not in table[1]:
                    continue
                v = tree_cpu([pid], table)
                self.first.setdefault((part, pid), v)
                self.last[(part, pid)] = v

    def used(self) -> dict[str, tuple[float, float]]:
        """Per part: (CPU seconds of its processes, with their children) since the first sample."""
        out: dict[str, tuple[float, float]] = {}
        for (part, pid), (own, total) in self.last.items():
            o0, t0 = self.first[(part, pid)]
            prev = out.get(part, (0.0, 0.0))
            out[part] = (prev[0] + own - o0, prev[1] + total - t0)
        return out


# ------------------------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class Sizes:
    workers: int
    per_process: int
    trajectories: int
    turns: int
    speed: float
    policy: str
    shared_connection: bool
    probe_hz: float

    @property
    def processes(self) -> int:
        return math.ceil(self.workers / self.per_process)


def job_spec(sizes: Sizes, traces: int) -> dict[str, Any]:
    """At least ``sizes.trajectories`` trajectories: groups of 16 (the coding workload's) over as many traces
    as that takes, larger groups once every trace is used."""
    group = 16 if sizes.trajectories <= 16 * traces else math.ceil(sizes.trajectories / traces)
    tasks = math.ceil(sizes.trajectories / group)
    return {
        "name": "fleet-bench",
        "dataset": {"name": "swe-replay", "limit": tasks},
        "group_size": group,
        "max_turns": sizes.turns,
        "policy": {"preset": sizes.policy},
    }


# ------------------------------------------------------------------------------------------------- stack


class Stack:
    """One deployment as ``loom up`` makes it, from this process: NATS (one server or a cluster) with the
    per-role users, the five services and the worker fleet's processes, supervised."""

    def __init__(self, home: Path, mode: str, sizes: Sizes) -> None:
        self.home = home
        self.mode = mode
        self.sizes = sizes
        self.passwords = nats_auth.passwords(home / "nats")
        auth = nats_auth.authorization(self.passwords)
        self.nats: NatsServer | NatsCluster = (
            NatsCluster(home / "nats", size=3, authorization=auth)
            if mode == "cluster"
            else NatsServer(home / "nats", authorization=auth)
        )
        self.sup = Supervisor(home / "logs")
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.token = new_token()
        self.url = ""
        self._fleet: list[ProcSpec] = []

    def nats_pids(self) -> list[int]:
        servers = self.nats.servers if isinstance(self.nats, NatsCluster) else [self.nats]
        return [s.proc.pid for s in servers if s.proc is not None]

    def pids(self) -> dict[str, list[int]]:
        by = self.sup.pids()
        out = {s: [by[s]] for s in SERVICES if s in by}
        out["rollout"] = [pid for name, pid in by.items() if name.startswith("fleet-")]
        out["nats"] = self.nats_pids()
        return out

    def cpu(self) -> dict[str, tuple[float, float]]:
        """Per part: (CPU seconds of its processes, with their children)."""
        table = proc_table()
        return {part: tree_cpu(pids, table) for part, pids in self.pids().items()}

    def specs(self, n: int) -> list[ProcSpec]:
        s = self.sizes
        common = {
            "LOOM_NATS_URL": self.url,
            "LOOM_SPEED": repr(s.speed),
            "LOOM_CLOCK_EPOCH": repr(time.time()),
            "LOOM_LOG_LEVEL": os.environ.get("LOOM_BENCH_LOG_LEVEL", "WARNING"),
            "LOOM_HOME": str(self.home),
            "LOOM_JS_REPLICAS": "3" if self.mode == "cluster" else "1",
            "LOOM_GEM_PYTHON": "",
            "PYTHONUNBUFFERED": "1",
        }

        def env(role: str, more: dict[str, str] | None = None) -> dict[str, str]:
            return {**common, **nats_auth.role_env(role, self.passwords[role]), **(more or {})}

        py = [sys.executable, "-m"]
        scheduler = {
            "LOOM_SCHEDULER_PORT": str(self.port),
            "LOOM_API_TOKEN": self.token,
            "LOOM_SCHEDULER_MAX_JOB_TRAJECTORIES": str(max(100_000, n)),
            "LOOM_SCHEDULER_TENANT_MAX_TRAJECTORIES": str(max(200_000, 2 * n)),
        }
        specs = [
            ProcSpec("scheduler", [*py, "services.scheduler"], env("scheduler", scheduler)),
            ProcSpec("router", [*py, "services.router"], env("router")),
            # The history-based predictor (no learned model in this home): the model's own inference cost
            # is `loom bench predictor`'s subject, not the control plane's.
            ProcSpec(
                "predictor",
                [*py, "services.predictor"],
                env("predictor", {"LOOM_PREDICTOR_METHOD": "history"}),
            ),
            ProcSpec("envmgr", [*py, "services.envmgr"], env("envmgr")),
            ProcSpec("reward", [*py, "services.reward"], env("reward")),
        ]
        left = s.workers
        for k in range(s.processes):
            count = min(s.per_process, left)
            left -= count
            argv = [*py, "services.rollout.fleet", "--count", str(count), "--prefix", f"f{k}w"]
            if s.shared_connection:
                argv.append("--shared-connection")
            more = {"LOOM_ROLLOUT_SEED": str(k * s.per_process), "LOOM_INSTANCE": f"fleet{k}"}
            specs.append(ProcSpec(f"fleet-{k}", argv, env("rollout", more)))
        return specs

    async def start(self, n: int, wait_s: float = 120.0) -> None:
        """NATS and the five services, until each answers and the router is active."""
        self.url = await self.nats.start()
        self._fleet = []
        for spec in self.specs(n):
            if spec.name.startswith("fleet-"):
                self._fleet.append(spec)
            else:
                await self.sup.start(spec)
        await self._until(0, wait_s)

    async def grow(
        self, settle_s: float, window_s: float, wait_s: float = 120.0
    ) -> list[tuple[int, dict[str, float]]]:
        """Start the fleet one process at a time; after each, every part's CPU (cores) with the fleet so far
        registered and no calls: ``(workers, cores by part)`` per step. What a worker costs with no calls."""
        sweep, workers = [], 0
        for spec in self._fleet:
            await self.sup.start(spec)
            workers += int(spec.argv[spec.argv.index("--count") + 1])
            await self._until(workers, wait_s)
            await asyncio.sleep(settle_s)
            c0, t0 = self.cpu(), time.monotonic()
            await asyncio.sleep(window_s)
            c1, t1 = self.cpu(), time.monotonic()
            sweep.append((workers, {p: _delta(c0, c1, p)[1] / (t1 - t0) for p in PARTS}))
        return sweep

    async def _until(self, workers: int, wait_s: float) -> None:
        """Until every service serves and the active router routes to ``workers`` workers."""
        deadline = time.monotonic() + wait_s
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            health = await gather(self.url, 0.5, self.credentials(nats_auth.OPERATOR))
            routers = [h.details for h in health.get("router", []) if h.details.get("role") == "active"]
            seen = {s: sum(h.ready for h in hs) for s, hs in health.items()}
            seen["routed_workers"] = len(routers[0]["workers"]) if routers else -1
            if all(seen.get(s, 0) >= 1 for s in SERVICES) and seen["routed_workers"] >= workers:
                return
            dead = [name for name, r in self.sup.restarts().items() if r > 2]
            if dead:
                raise RuntimeError(f"fleet bench: {dead} keep crashing; see {self.home / 'logs'}")
            await asyncio.sleep(0.5)
        raise RuntimeError(f"fleet bench: not up after {wait_s:.0f} s: {seen}; see {self.home / 'logs'}")

    def credentials(self, role: str) -> tuple[str, str]:
        return role, self.passwords[role]

    async def connect(self, role: str) -> NATS:
        return await bus.connect(self.url, f"bench-fleet-{role}", credentials=self.credentials(role))

    async def stop(self) -> None:
        await self.sup.stop()
        await self.nats.stop()


# ------------------------------------------------------------------------------------------------ probes


@dataclass
class Probe:
    """Paired one-token calls: through the router, then straight to the worker it chose (see the docstring).
    Answers come to one subscription made up front, so that on a cluster every server knows where they go
    before the first call (a fresh inbox per call could be answered before its interest crossed the routes)."""

    caller: NATS  # as the environment manager: asks the router, and receives the workers' answers
    forwarder: NATS  # as the router: forwards to a worker directly
    speed: float
    routed: list[float] = field(default_factory=list)
    direct: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)
    _base: str = ""
    _waiting: dict[str, asyncio.Queue[bytes]] = field(default_factory=dict)

    async def open(self) -> None:
        self._base = self.caller.new_inbox()

        async def on_answer(msg: Any) -> None:
            q = self._waiting.get(msg.subject)
            if q is not None:
                q.put_nowait(msg.data)

        await self.caller.subscribe(f"{self._base}.*", cb=on_answer)
        await self.caller.flush()

    async def _call(self, req: GenRequest, worker: str | None) -> tuple[float, GenResult]:
        inbox = f"{self._base}.{req.rid.rsplit('.', 1)[-1]}"  # r<i> or d<i>: one call each
        answers = self._waiting[inbox] = asyncio.Queue()
        try:
            t0 = time.perf_counter()
            if worker is None:
                await self.caller.publish(subjects.GEN_REQUEST, encode(req), reply=inbox)
            else:
                req.reply_to = inbox
                await self.forwarder.publish(subjects.worker_gen(worker), encode(req))
            while True:
                data = await asyncio.wait_for(answers.get(), 10)
                try:
                    ev = decode_union(data, GenEvent | ErrorReply)
                except DecodeError:
                    continue
                if isinstance(ev, GenResult):
                    # Less the engine's own time (simulated seconds, sped up): what is left is messaging.
                    engine = (ev.queue_s + ev.prefill_s + ev.decode_s) / self.speed
                    return time.perf_counter() - t0 - engine, ev
                if not isinstance(ev, GenEvent):
                    raise RuntimeError(f"probe {req.rid}: {ev}")
        finally:
            del self._waiting[inbox]

    async def run(self, stop: asyncio.Event, hz: float) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            leg = "routed"
            try:
                req = GenRequest(f"{PROBE_JOB}.p0.r{i}", PROBE_JOB, "p0", i, 1, 1, ignore_eos=True)
                routed, res = await self._call(req, None)
                leg = "direct"
                direct_req = GenRequest(f"{PROBE_JOB}.p0.d{i}", PROBE_JOB, "p0", i, 1, 1, ignore_eos=True)
                direct, _ = await self._call(direct_req, res.worker_id)
            except Exception as e:
                why = f"{leg}: {type(e).__name__}: {e}"[:120]
                self.failed[why] = self.failed.get(why, 0) + 1
            else:
                self.routed.append(routed)
                self.direct.append(direct)
                self.overhead.append(routed - direct)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0 / hz)

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float]) -> dict[str, float]:
            if not xs:
                return {"p50": 0.0, "p99": 0.0}
            return {q: round(float(np.percentile(xs, int(q[1:]))) * 1000, 3) for q in ("p50", "p99")}

        return {
            "overhead_ms": pct(self.overhead),
            "routed_ms": pct(self.routed),
            "direct_ms": pct(self.direct),
            "pairs": len(self.overhead),
            "failed": self.failed,
        }


# ------------------------------------------------------------------------------------------------ metrics


async def metric(nc: NATS, service: str, name: str) -> float:
    """The sum of one counter's samples over a service's instances' expositions (asked as the operator)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    total = 0.0
    try:
        await nc.publish(subjects.metrics(service), b"", reply=inbox)
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                break
            for fam in text_string_to_metric_families(msg.data.decode()):
                for s in fam.samples:
                    if s.name == name:
                        total += s.value
            if service != "rollout":
                break  # one instance
    finally:
        await sub.unsubscribe()
    return total


# -------------------------------------------------------------------------------------------------- a run


async def _run_stack(
    mode: str, sizes: Sizes, home: Path, spec: dict[str, Any], quick: bool
) -> dict[str, Any]:
    stack = Stack(home, mode, sizes)
    n = spec["dataset"]["limit"] * spec["group_size"]
    try:
        t0 = time.monotonic()
        await stack.start(n)
        sweep = await stack.grow(settle_s=0.5 if quick else 1.0, window_s=2.0 if quick else 4.0)
        up_s = time.monotonic() - t0
        operator = await stack.connect(nats_auth.OPERATOR)
        caller = await stack.connect("envmgr")
        forwarder = await stack.connect("router")
        try:
            out = await _measure(stack, operator, caller, forwarder, spec, n, idle=sweep[-1][1])
            out["router_idle_sweep"] = [[w, round(c["router"], 4)] for w, c in sweep]
            out["up_s"] = round(up_s, 1)
            out["restarts"] = {k: v for k, v in stack.sup.restarts().items() if v}
            return out
        finally:
            for nc in (operator, caller, forwarder):
                await nc.close()
    finally:
        restarts = stack.sup.restarts()
        await stack.stop()
        if any(restarts.values()):
            Console(stderr=True).print(f"[yellow]fleet bench ({mode}): restarts {restarts}[/]")


async def _measure(
    stack: Stack,
    operator: NATS,
    caller: NATS,
    forwarder: NATS,
    spec: dict[str, Any],
    n: int,
    idle: dict[str, float],
) -> dict[str, Any]:
    """Submit the job and measure it (module docstring); ``idle``: each part's cores with the whole fleet up
    and no calls."""
    sizes = stack.sizes

    probe = Probe(caller, forwarder, sizes.speed)
    await probe.open()
    stop_probe = asyncio.Event()
    # (wall time, router requests so far), about every second of the job.
    series: list[tuple[float, float]] = []
    async with httpx.AsyncClient(base_url=stack.api, headers=header(stack.token), timeout=60) as http:
        calls0 = await metric(operator, "router", "loom_router_requests_total")
        meter = CpuMeter(stack.pids)
        meter.sample()
        t_post = time.monotonic()
        r = await http.post("/v1/jobs", json=spec)
        if r.status_code != 201:
            raise RuntimeError(f"fleet bench: the job was refused ({r.status_code}): {r.text}")
        post_s = time.monotonic() - t_post
        job_id = r.json()["id"]
        probe_task = asyncio.create_task(probe.run(stop_probe, sizes.probe_hz))
        t_running: float | None = None
        last_poll = 0.0
        job: dict[str, Any] = {}
        deadline = t_post + max(600.0, n / 20)
        poll_errors = 0
        while time.monotonic() < deadline:
            try:
                job = (await http.get(f"/v1/jobs/{job_id}")).raise_for_status().json()
            except httpx.HTTPError:
                # A busy scheduler may drop a kept-alive connection; a restarted one comes back: ask again.
                poll_errors += 1
                await asyncio.sleep(0.5)
                continue
            now = time.monotonic()
            if t_running is None and job["state"] in ("running", "completed"):
                t_running = now
            if now - last_poll >= 1.0:
                last_poll = now
                meter.sample()
                series.append((now, await metric(operator, "router", "loom_router_requests_total")))
            if job["state"] in ("completed", "failed", "cancelled"):
                break
            await asyncio.sleep(0.2)
        t_done = time.monotonic()
        meter.sample()
        used = meter.used()
        stop_probe.set()
        await probe_task
    if job.get("state") != "completed":
        raise RuntimeError(f"fleet bench: the job did not complete: {job}")
    calls = int(await metric(operator, "envmgr", "loom_envmgr_steps_total"))
    series.append((t_done, await metric(operator, "router", "loom_router_requests_total")))
    wall = t_done - t_post
    cpu = {p: used.get(p, (0.0, 0.0))[1] for p in PARTS}
    # Each service's own process: its one event loop, which cannot use more than one core.
    loop = {p: used.get(p, (0.0, 0.0))[0] for p in SERVICES}
    capacity = {p: round(calls / loop[p]) if loop[p] > 0 else None for p in SERVICES}
    steady = _steady_rate(series, calls0)
    p = probe.summary()
    return {
        "nats": stack.mode,
        "workers": sizes.workers,
        "worker_processes": sizes.processes,
        "trajectories": n,
        "completed": job["completed"],
        "failed": job["failed"],
        "calls": calls,
        "calls_per_trajectory": round(calls / max(1, n), 2),
        "calls_per_s": round(steady, 1),
        "calls_per_s_job": round(calls / wall, 1),
        "job_s": round(wall, 1),
        "router_overhead_ms": p["overhead_ms"],
        "probe": p,
        "intake_traj_per_s": round(n / max(1e-9, (t_running or t_done) - t_post), 1),
        "intake_s": round((t_running or t_done) - t_post, 2),
        "post_ms": round(post_s * 1000, 1),
        "status_poll_errors": poll_errors,
        "cpu_s_per_1k_calls": {part: round(cpu[part] / max(1, calls) * 1000, 3) for part in PARTS},
        "cpu_s_per_1k_trajectories": {part: round(cpu[part] / max(1, n) * 1000, 2) for part in PARTS},
        "cores": {part: round(cpu[part] / wall, 3) for part in PARTS},
        "loop_cpu_s_per_1k_calls": {p: round(loop[p] / max(1, calls) * 1000, 3) for p in SERVICES},
        "capacity_calls_per_s": capacity,
        "idle_cores": {part: round(idle[part], 4) for part in PARTS},
        "router_cpu_ms_per_call": round(cpu["router"] / max(1, calls) * 1000, 4),
        "router_idle_cores": round(idle["router"], 4),
    }


def _delta(
    a: dict[str, tuple[float, float]], b: dict[str, tuple[float, float]], part: str
) -> tuple[float, float]:
    x, y = a.get(part, (0.0, 0.0)), b.get(part, (0.0, 0.0))
    return y[0] - x[0], y[1] - x[1]


def _steady_rate(series: list[tuple[float, float]], base: float) -> float:
    """Calls per second while the job's middle 80% of calls went through the router (its counter, sampled)."""
    if len(series) < 3:
        return 0.0
    ts = np.array([t for t, _ in series])
    cs = np.array([c - base for _, c in series])
    total = cs[-1]
    if total <= 0:
        return 0.0
    lo_t, hi_t = np.interp([0.1 * total, 0.9 * total], cs, ts)
    return float(0.8 * total / (hi_t - lo_t)) if hi_t > lo_t else 0.0


# --------------------------------------------------------------------------------------- Heddle call rates


def call_rates(quick: bool) -> dict[str, dict[str, float]]:
    """Calls per second one H100 issues in each Heddle workload: the workload on 8 H100 (Qwen3-14B, Heddle's
    policy, exact lengths) in virtual time; over its whole makespan and over its busiest tenth."""
    from loom.bench.harness.cluster import Cluster
    from loom.bench.harness.rollout import run_rollout
    from loom.bench.rollout import GROUP, load_workload
    from loom.workloads import planned_env_s

    gpus = 8
    out: dict[str, dict[str, float]] = {}
    for name in WORKLOADS:
        prompts = (8 if quick else 32) if name == "coding" else None
        w = load_workload(name, prompts, GROUP[name], 0)
        cl = Cluster(gpus=gpus, gpu="h100", model="qwen3-14b", tool_s=planned_env_s(name, GROUP[name], 0))
        r = run_rollout(w, PRESETS["heddle"], cl, "oracle", 0)
        calls = sum(len(t.steps) for t in w.trajectories)
        times = np.array([t for t, _ in r.steps_done])
        hist, _ = np.histogram(times, bins=10, range=(0.0, r.makespan_s))
        out[name] = {
            "trajectories": len(w.trajectories),
            "calls": calls,
            "makespan_s": round(r.makespan_s, 1),
            "calls_per_gpu_s": round(calls / r.makespan_s / gpus, 3),
            "peak_calls_per_gpu_s": round(float(hist.max()) / (r.makespan_s / 10) / gpus, 3),
        }
    return out


def idle_exponent(sweep: list[list[float]]) -> float:
    """k of the router's idle cores ~ workers^k, fitted over the sweep (log-log least squares); 1 from fewer
    than two points that are clear of the clock's resolution, and kept within [1, 2] (at least linear, at most every worker's event visiting all)."""
    # Below a fiftieth of a core the kernel's clock ticks (10 ms) over a few seconds say little.
    pts = [(math.log(w), math.log(c)) for w, c in sweep if w > 0 and c >= 0.02]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return 1.0
    x, y = np.array(pts).T
    k = float(np.polyfit(x, y, 1)[0])
    return min(2.0, max(1.0, k))


def fleet_limit(idle_w: float, workers: int, k: float) -> int | None:
    """The largest fleet whose idle cost alone, idle_w (G / workers)^k cores, fits in one core; None where the
    idle cost was too small to measure (below the clock's tick over the window): no limit seen."""
    if idle_w <= 0:
        return None
    return int(workers * (1.0 / idle_w) ** (1.0 / k))


def max_gpus(run: dict[str, Any], rates: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The largest fleet of single-GPU workers one router core serves at each workload's call rate: the calls
    one router core carries (its CPU per call over the job, everything it did meanwhile included) over the
    calls one GPU issues, and never more than the fleet whose idle cost alone fills the core."""
    k = idle_exponent(run["router_idle_sweep"])
    idle_only = fleet_limit(run["router_idle_cores"], run["workers"], k)
    per_call = run["router_cpu_ms_per_call"] / 1000
    per_core = 1.0 / per_call if per_call > 0 else math.inf

    def limit(rate: float) -> int | None:
        bounds = [b for b in (idle_only, per_core / rate if rate > 0 else math.inf) if b is not None]
        best = min(bounds, default=math.inf)
        return int(best) if best < math.inf else None

    by = {
        name: {"at_peak": limit(r["peak_calls_per_gpu_s"]), "at_mean": limit(r["calls_per_gpu_s"])}
        for name, r in rates.items()
    }
    return {
        "max_gpus_served": min((v["at_peak"] for v in by.values() if v["at_peak"] is not None), default=None),
        "max_gpus_idle_only": idle_only,
        "router_idle_exponent": round(k, 3),
        "router_calls_per_core_s": round(per_core, 1) if per_core < math.inf else None,
        "by_workload": by,
    }


# ------------------------------------------------------------------------------------------------- report


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def compare(single: dict[str, Any], cluster: dict[str, Any]) -> dict[str, Any]:
    """The cluster's figures over the single server's."""
    return {
        "calls_per_s": _ratio(cluster["calls_per_s"], single["calls_per_s"]),
        "router_overhead_p50": _ratio(
            cluster["router_overhead_ms"]["p50"], single["router_overhead_ms"]["p50"]
        ),
        "router_overhead_p99": _ratio(
            cluster["router_overhead_ms"]["p99"], single["router_overhead_ms"]["p99"]
        ),
        "intake_traj_per_s": _ratio(cluster["intake_traj_per_s"], single["intake_traj_per_s"]),
        "max_gpus_served": _ratio(cluster["max_gpus_served"], single["max_gpus_served"]),
        "cpu_s_per_1k_calls": {
            p: _ratio(cluster["cpu_s_per_1k_calls"][p], single["cpu_s_per_1k_calls"][p]) for p in PARTS
        },
    }


# The services that run one active instance (a lease elects it); the others share work by queue groups.
UNSHARDED = ("scheduler", "router")


def saturates_first(run: dict[str, Any], among: tuple[str, ...] = SERVICES) -> str:
    """The service whose one process fills a core at the fewest calls per second (``capacity_calls_per_s``:
    calls carried over its own process's CPU share; its event loop cannot use more than one core)."""
    cap = run["capacity_calls_per_s"]
    return min((s for s in among if cap[s]), key=lambda s: cap[s])


def _print(out: dict[str, Any]) -> None:
    runs = [out[m] for m in ("single", "cluster") if m in out]
    con = Console()
    t = Table(
        title=f"Control plane at fleet scale: {out['workers']} workers, {out['trajectories']:,} trajectories"
    )
    t.add_column("")
    for r in runs:
        t.add_column(r["nats"], justify="right")
    rows = [
        ("calls/s (steady)", lambda r: f"{r['calls_per_s']:,.0f}"),
        ("calls/s (whole job)", lambda r: f"{r['calls_per_s_job']:,.0f}"),
        ("router overhead p50 ms", lambda r: f"{r['router_overhead_ms']['p50']:.2f}"),
        ("router overhead p99 ms", lambda r: f"{r['router_overhead_ms']['p99']:.2f}"),
        ("intake traj/s", lambda r: f"{r['intake_traj_per_s']:,.0f}"),
        ("router ms CPU per call", lambda r: f"{r['router_cpu_ms_per_call']:.3f}"),
        ("max GPUs one router serves", lambda r: f"{r['max_gpus_served']:,}"),
        ("job s", lambda r: f"{r['job_s']:.0f}"),
    ]
    for label, fn in rows:
        t.add_row(label, *(fn(r) for r in runs))
    con.print(t)
    c = Table(title="CPU seconds per 1,000 calls (cores busy)")
    c.add_column("")
    for r in runs:
        c.add_column(r["nats"], justify="right")
    for part in PARTS:
        c.add_row(part, *(f"{r['cpu_s_per_1k_calls'][part]:.3f} ({r['cores'][part]:.2f})" for r in runs))
    con.print(c)
    m = out["machine"]
    con.print(
        f"ran on {m['cpu']}, {m['cpus_usable']} of {m['cpus']} CPUs usable, {m['memory_gib']} GiB, load "
        f"{m['load_1m_at_start']} at the start; {m['nats_server']}"
    )
    for r in runs:
        figs = r["repeats"]
        con.print(
            f"{r['nats']}, {out['repeat']} run(s), the median run shown: "
            + ", ".join(
                f"{name} {f['median']:,} ({f['min']:,}-{f['max']:,}, spread {f['spread']})"
                for name, f in figs.items()
                if name in ("calls_per_s", "max_gpus_served", "router_overhead_p99_ms")
            )
        )
    con.print(
        f"saturates first: {out['saturates_first']} (of the single-instance services: "
        f"{out['saturates_first_unsharded']}); {out['max_gpus_derivation']}"
    )


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    workers = args.workers or (32 if quick else 256)
    sizes = Sizes(
        workers=workers,
        per_process=min(args.per_process, workers),
        trajectories=args.trajectories or (1000 if quick else 20_000),
        turns=args.turns,
        speed=args.speed,
        policy=args.policy,
        shared_connection=args.shared_connection,
        probe_hz=args.probe_hz,
    )
    modes = {"both": ["single", "cluster"], "single": ["single"], "cluster": ["cluster"]}[
        args.nats or ("single" if quick else "both")
    ]
    repeat = args.repeat or (1 if quick else 3)
    if repeat < 1:
        raise SystemExit("--repeat: at least 1")
    ran_on = machine(nats_server=_nats_version())
    rates = await asyncio.to_thread(call_rates, quick)
    spec = job_spec(sizes, len(load_traces(None)))
    runs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        tries = []
        for i in range(repeat):
            if args.keep:
                home = Path(args.keep) / (mode if repeat == 1 else f"{mode}-{i}")
                home.mkdir(parents=True, exist_ok=True)
                tries.append(await _run_stack(mode, sizes, home, spec, quick))
            else:
                with tempfile.TemporaryDirectory(prefix=f"loom-bench-fleet-{mode}-") as tmp:
                    tries.append(await _run_stack(mode, sizes, Path(tmp), spec, quick))
            tries[-1].update(max_gpus(tries[-1], rates))
        runs[mode] = {**median_run(tries, lambda r: r["calls_per_s"]), "repeats": repeats(tries)}
    top = runs.get("cluster") or runs["single"]
    worst = min(rates, key=lambda w: top["by_workload"][w]["at_peak"])
    out: dict[str, Any] = {
        "benchmark": "fleet",
        "nats": top["nats"],
        **{k: top[k] for k in ("workers", "trajectories", "calls", "calls_per_s", "router_overhead_ms")},
        **{k: top[k] for k in ("intake_traj_per_s", "cpu_s_per_1k_calls", "max_gpus_served")},
        "speed": sizes.speed,
        "turns": sizes.turns,
        "policy": sizes.policy,
        "shared_connection": sizes.shared_connection,
        "call_rates": rates,
        "repeat": repeat,
        "spread": top["repeats"],
        "machine": ran_on,
        **runs,
    }
    if "single" in runs and "cluster" in runs:
        out["cluster_over_single"] = compare(runs["single"], runs["cluster"])
    out["saturates_first"] = saturates_first(top)
    out["saturates_first_unsharded"] = saturates_first(top, UNSHARDED)
    out["max_gpus_derivation"] = (
        f"router: {top['router_cpu_ms_per_call']:.3f} ms CPU per call with {top['workers']} workers -> "
        f"{top['router_calls_per_core_s'] or 0:,.0f} calls per core-second; {worst} issues "
        f"{rates[worst]['peak_calls_per_gpu_s']:.1f} calls/s per H100 at its peak -> one router core serves "
        f"{top['max_gpus_served']:,} GPUs; idle, the fleet alone costs it {top['router_idle_cores']:.3f} "
        f"cores, growing as workers^{top['router_idle_exponent']:.2f} (sweep {top['router_idle_sweep']}): "
        + (
            f"a core at {top['max_gpus_idle_only']:,} workers"
            if top["max_gpus_idle_only"] is not None
            else "too little to measure"
        )
    )
    return out


# The headline figures a repeat reports the median and range of (the rest are the median run's).
REPEATED: dict[str, Callable[[dict[str, Any]], float]] = {
    "calls_per_s": lambda r: r["calls_per_s"],
    "calls_per_s_job": lambda r: r["calls_per_s_job"],
    "router_overhead_p50_ms": lambda r: r["router_overhead_ms"]["p50"],
    "router_overhead_p99_ms": lambda r: r["router_overhead_ms"]["p99"],
    "intake_traj_per_s": lambda r: r["intake_traj_per_s"],
    "router_cpu_ms_per_call": lambda r: r["router_cpu_ms_per_call"],
    "max_gpus_served": lambda r: r["max_gpus_served"],
}


def repeats(tries: list[dict[str, Any]]) -> dict[str, Any]:
    return {name: spread([float(fig(r)) for r in tries]) for name, fig in REPEATED.items()}


def _nats_version() -> str:
    try:
        r = subprocess.run(
            [find_binary(), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError, NatsServerError) as e:
        return f"unknown ({e})"
    return r.stdout.strip() or r.stderr.strip()


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = asyncio.run(_main(args))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    _print(out)
    return out


BENCHMARK = Benchmark(
    "fleet",
    "the control plane at fleet scale: hundreds of simulated workers over one nats-server and a NATS cluster",
    add_arguments,
    run,
)

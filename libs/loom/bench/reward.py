"""``loom bench reward``: the reward service's autoscaled, scale-to-zero pool against a fixed dedicated pool.

Three RL jobs (tenants) share the reward service, each finishing GRPO steps in bursts: a step's
trajectories end over a long-tailed spread of a second or two, then the job trains for a few seconds and
sends nothing. Their rewards are real: GSM8K test and train answers written as a model would (a LaTeX
``\\boxed{}`` answer, a fifth of them wrong) through math-verify, and HumanEval canonical solutions (a fifth
broken) run against their tests in sandboxes. The same arrival schedule runs twice, each time on a private
nats-server with the reward service as its own process:

- ``autoscaled``: the Knative-style autoscaler grows the pool in a burst and scales it to zero after;
- ``fixed``: a dedicated pool of as many workers as the autoscaled run's peak, up all the time.

Utilisation is busy worker-seconds (a worker holding at least one request) over provisioned
worker-seconds (spawn to exit), from the first arrival until the autoscaled pool is back at zero (the fixed
pool: until the last result). Latency runs from publishing a request to its stored result's event.
``scale_from_zero_ms`` is that latency for a request sent to a pool at zero workers (median of probes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import nats
import numpy as np
from nats.aio.msg import Msg
from rich.console import Console
from rich.table import Table

from loom.bench.registry import Benchmark
from loom.envs import tasksets
from loom.protocol import (
    Health,
    RewardRequest,
    Step,
    TaskSpec,
    TrajDone,
    Trajectory,
    decode,
    encode,
    subjects,
)
from loom.runtime import bus
from loom.runtime.natsserver import NatsServer
from loom.sandbox import SandboxUnavailable
from loom.sandbox.engine import ensure_engine
from loom.sandbox.images import DEFAULT_IMAGE, build

ROOT = Path(__file__).resolve().parents[3]
JOBS = ("math", "code", "math-train")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per job (5; quick 2)")
    p.add_argument("--sandbox", choices=["auto", "docker", "process"], default="auto")
    p.add_argument("--max-workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Arrival:
    at: float
    job: str
    req: RewardRequest


def _traj(job: str, i: int, action: str) -> Trajectory:
    step = Step(0, 100, 200, action=action)
    return Trajectory(job, f"t{i}", "", 0, i, "math", "completed", "stop", [step], 0.0, 1.0)


def _wrong(answer: str) -> str:
    f = Fraction(answer)
    return str(f + 1)


def _requests(job: str, n: int, rng: np.random.Generator, offset: int) -> list[RewardRequest]:
    out = []
    if job == "code":
        code = list(tasksets.humaneval().values())
        for k in range(n):
            c = code[(offset + k) % len(code)]
            body = c.reference if rng.random() >= 0.2 else "    return None\n"
            text = f"```python\n{c.prompt}{body}```"
            out.append(
                RewardRequest(_traj(job, offset + k, text), "code", job, TaskSpec(c.id, {"set": "humaneval"}))
            )
        return out
    split = "test" if job == "math" else "train"
    problems = list(tasksets.gsm8k(split=split).values())
    for k in range(n):
        t = problems[(offset + k) % len(problems)]
        ans = t.answer if rng.random() >= 0.2 else _wrong(t.answer)
        text = re.sub(r"####\s*.+$", f"The answer is $\\\\boxed{{{ans}}}$.", t.solution.strip())
        name = "gsm8k" if split == "test" else "gsm8k-train"
        out.append(RewardRequest(_traj(job, offset + k, text), "math", job, TaskSpec(t.id, {"set": name})))
    return out


def schedule(steps: int, seed: int) -> list[Arrival]:
    """Each job: a burst per step (trajectories finishing over a long-tailed ~1.5 s), then a training gap."""
    rng = np.random.default_rng(seed)
    sizes = {"math": 160, "code": 24, "math-train": 160}
    gaps = {"math": 6.0, "code": 7.0, "math-train": 8.0}
    out: list[Arrival] = []
    for j, job in enumerate(JOBS):
        t = 0.8 * j
        for s in range(steps):
            n = sizes[job]
            spread = np.sort(rng.lognormal(0.0, 0.6, n))
            times = t + 1.5 * spread / spread[-1]
            for at, req in zip(times, _requests(job, n, rng, s * n), strict=True):
                out.append(Arrival(float(at), job, req))
            t = float(times[-1]) + gaps[job]
    return sorted(out, key=lambda a: a.at)


async def _health(nc: Any) -> dict[str, Any]:
    reply = await nc.request(subjects.health("reward"), b"", timeout=5)
    return decode(reply.data, Health).details


async def _wait(nc: Any, pred: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            h = await _health(nc)
            if pred(h):
                return h
        except Exception:
            h = {}
        if time.monotonic() > deadline:
            raise TimeoutError(f"reward service did not reach the expected state; last health: {h}")
        await asyncio.sleep(0.05)


async def _run_pool(
    mode: str, arrivals: list[Arrival], args: argparse.Namespace, fixed: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loom-bench-reward-") as tmp:
        server = NatsServer(Path(tmp) / "nats", port=0)
        url = await server.start()
        env = dict(
            os.environ,
            LOOM_NATS_URL=url,
            LOOM_INSTANCE=f"bench-{mode}",
            LOOM_LOG_LEVEL=os.environ.get("LOOM_BENCH_LOG_LEVEL", "WARNING"),
            LOOM_REWARD_MAX_WORKERS=str(args.max_workers),
            LOOM_REWARD_WORKER_SLOTS="4",
            LOOM_REWARD_TARGET="4",
            # Bursts last seconds here, so the windows are seconds: a stable window of 60 s would hold
            # a burst's workers through the next one and measure the window, not the policy.
            LOOM_REWARD_STABLE_WINDOW_S="0.4",
            LOOM_REWARD_PANIC_WINDOW_S="0.2",
            LOOM_REWARD_SCALE_TO_ZERO_GRACE_S="0.2",
            LOOM_REWARD_SANDBOX_BACKEND=args.sandbox,
        )
        if mode == "fixed":
            env["LOOM_REWARD_FIXED_WORKERS"] = str(fixed)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.reward", cwd=ROOT, env=env
        )
        nc = await nats.connect(url)
        try:
            await bus.ensure_streams(nc.jetstream())
            return await _drive(nc, mode, arrivals, fixed)
        finally:
            await nc.close()
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
            await server.stop()


async def _drive(nc: Any, mode: str, arrivals: list[Arrival], fixed: int) -> dict[str, Any]:
    js = nc.jetstream()
    done: dict[str, float] = {}
    got = asyncio.Event()

    async def on_done(m: Msg) -> None:
        ev = decode(m.data, TrajDone)
        done.setdefault(f"{ev.job_id}.{ev.traj_id}", time.monotonic())
        got.set()

    await nc.subscribe(subjects.TRAJ_DONE_ALL, cb=on_done)
    if mode == "fixed":
        await _wait(nc, lambda h: sum(w["ready"] for w in h["workers"]) >= fixed, 60)
    else:
        await _wait(nc, lambda h: "workers" in h, 60)
    h0 = await _health(nc)
    sent: dict[str, float] = {}
    t0 = time.monotonic()
    for a in arrivals:
        delay = t0 + a.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        key = f"{a.job}.{a.req.trajectory.traj_id}"
        sent[key] = time.monotonic()
        await js.publish(subjects.reward_submit(a.job, a.job), encode(a.req), headers={"Nats-Msg-Id": key})
    while len(done) < len(arrivals):
        got.clear()
        await asyncio.wait_for(got.wait(), 120)
    last = time.monotonic()
    if mode == "autoscaled":
        h1 = await _wait(nc, lambda h: not h["workers"], 60)
    else:
        h1 = await _health(nc)
    lat = [done[k] - sent[k] for k in sent]
    out: dict[str, Any] = {
        "utilization": _ratio(
            h1["busy_seconds"] - h0["busy_seconds"], h1["worker_seconds"] - h0["worker_seconds"]
        ),
        "worker_seconds": round(h1["worker_seconds"] - h0["worker_seconds"], 1),
        "busy_seconds": round(h1["busy_seconds"] - h0["busy_seconds"], 1),
        "latency_ms": {"p50": _ms(lat, 50), "p99": _ms(lat, 99)},
        "requests": len(lat),
        "load_s": round(last - t0, 1),
        "cold_starts": h1["cold_starts"] - h0["cold_starts"],
        "peak_workers": fixed if mode == "fixed" else h1["peak_workers"],
    }
    if mode == "autoscaled":
        out["scale_from_zero_ms"] = await _from_zero(nc, js, done, got, arrivals[0].req)
    return out


async def _from_zero(
    nc: Any, js: Any, done: dict[str, float], got: asyncio.Event, like: RewardRequest
) -> float:
    lat = []
    for i in range(3):
        await _wait(nc, lambda h: not h["workers"], 60)
        traj = _traj("probe", 10_000_000 + i, like.trajectory.steps[-1].action)
        req = RewardRequest(traj, like.kind, "probe", like.task)
        key = f"probe.{traj.traj_id}"
        t = time.monotonic()
        await js.publish(subjects.reward_submit("probe", "probe"), encode(req), headers={"Nats-Msg-Id": key})
        while key not in done:
            got.clear()
            await asyncio.wait_for(got.wait(), 60)
        lat.append(done[key] - t)
    return round(float(np.median(lat)) * 1000, 1)


def _ms(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)) * 1000, 1)


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else 0.0


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps or (2 if args.quick else 5)
    if args.sandbox != "process":
        # The workers' sandboxes need the engine and the image; start and build them here, once.
        if await ensure_engine(start=True):
            await build(say=lambda s: Console(stderr=True).print(s))
        elif args.sandbox == "docker":
            raise SandboxUnavailable("no Docker engine answers and none could be started")
    arrivals = schedule(steps, args.seed)
    auto = await _run_pool("autoscaled", arrivals, args, 0)
    fixed = await _run_pool("fixed", arrivals, args, max(1, auto["peak_workers"]))
    return {
        "benchmark": "reward",
        "jobs": {j: sum(a.job == j for a in arrivals) for j in JOBS},
        "steps": steps,
        "autoscaled": auto,
        "fixed": fixed,
        "scale_from_zero_ms": auto.pop("scale_from_zero_ms"),
        "utilization_ratio": _ratio(auto["utilization"], fixed["utilization"]),
        "worker_seconds_saving": _ratio(fixed["worker_seconds"], auto["worker_seconds"]),
        "image": DEFAULT_IMAGE if args.sandbox != "process" else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = asyncio.run(_main(args))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    t = Table(title=f"Reward pools: {sum(out['jobs'].values())} requests from 3 jobs in bursts")
    for c in ("pool", "workers", "utilisation", "worker-s", "busy-s", "p50 ms", "p99 ms", "cold starts"):
        t.add_column(c, justify="right")
    for mode in ("autoscaled", "fixed"):
        r = out[mode]
        t.add_row(
            mode,
            f"0..{r['peak_workers']}" if mode == "autoscaled" else str(r["peak_workers"]),
            f"{r['utilization']:.3f}",
            str(r["worker_seconds"]),
            str(r["busy_seconds"]),
            str(r["latency_ms"]["p50"]),
            str(r["latency_ms"]["p99"]),
            str(r["cold_starts"]),
        )
    Console().print(t)
    Console().print(
        f"scale from zero: {out['scale_from_zero_ms']} ms; autoscaled uses "
        f"{out['worker_seconds_saving']}x fewer worker-seconds"
    )
    return out


BENCHMARK = Benchmark(
    "reward", "autoscaled scale-to-zero reward pool vs a fixed dedicated pool", add_arguments, run
)

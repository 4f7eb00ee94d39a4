"""``loom bench sandbox``: exec latency in warm sandboxes, and many sandboxes busy at once.

- latency: ``python3 -c pass`` in sandboxes taken from the warm pool, one exec at a time; the baseline
  is a session's first exec without a pool (the container started on demand), reported as a ratio;
- concurrency: ``--concurrent`` sessions (64; 16 with ``--quick``) hold a sandbox each and run a small
  Python workload in a loop for ``--seconds``; every failed exec or engine error counts.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from loom.bench.registry import Benchmark
from loom.sandbox import Limits, SandboxError
from loom.sandbox.engine import choose_backend
from loom.sandbox.images import DEFAULT_IMAGE, build
from loom.sandbox.pool import Backend, SandboxPool

LIMITS = Limits(cpus=1.0, memory_mb=256, pids=64, timeout_s=30.0)
WORK = "s = 0\nfor i in range(20000):\n    s += i * i\nprint(s)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["auto", "docker", "process"], default="docker")
    p.add_argument("--image", default=DEFAULT_IMAGE)
    p.add_argument("--concurrent", type=int, default=None, help="sandboxes busy at once (64; quick 16)")
    p.add_argument("--seconds", type=float, default=None, help="how long they stay busy (30; quick 8)")
    p.add_argument("--execs", type=int, default=None, help="latency samples (200; quick 60)")


def _pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)) * 1000, 1) if xs else float("nan")


async def _latency(backend: Backend, n: int) -> tuple[list[float], list[float]]:
    pool = SandboxPool(backend, LIMITS, warm=4, max_sandboxes=8)
    await pool.start()
    await pool.fill()
    try:
        lat: list[float] = []
        i = 0
        while len(lat) < n:  # a fresh session from the warm pool every 4 execs, as short tool loops do
            async with pool.session(f"lat-{i}") as sb:
                for _ in range(min(4, n - len(lat))):
                    r = await sb.exec(["python3", "-c", "pass"])
                    if not r.ok:
                        raise SandboxError(f"python3 -c pass failed: {r.stderr[-300:]}")
                    lat.append(r.duration_s)
            i += 1
        cold: list[float] = []
        for _ in range(5):  # the baseline: no warm pool, so the session's first call starts its container
            t0 = time.perf_counter()
            sb = await backend.create(LIMITS)
            r = await sb.exec(["python3", "-c", "pass"])
            cold.append(time.perf_counter() - t0)
            await sb.close()
            if not r.ok:
                raise SandboxError(f"cold exec failed: {r.stderr[-300:]}")
        return lat, cold
    finally:
        await pool.close()


async def _concurrent(backend: Backend, n: int, seconds: float) -> dict[str, Any]:
    pool = SandboxPool(backend, LIMITS, warm=n, max_sandboxes=n, create_concurrency=4)
    t0 = time.perf_counter()
    await pool.start()
    await pool.fill(timeout_s=600)
    warm_s = time.perf_counter() - t0
    lat: list[float] = []
    errors: list[str] = []
    end = time.perf_counter() + seconds

    async def session(i: int) -> None:
        try:
            async with pool.session(f"c-{i}") as sb:
                while time.perf_counter() < end:
                    r = await sb.exec(["python3", "-c", WORK])
                    lat.append(r.duration_s)
                    if not r.ok or r.stdout.strip() != str(sum(k * k for k in range(20000))):
                        errors.append(f"exit {r.exit_code}: {r.stderr[-200:]}")
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    try:
        await asyncio.gather(*(session(i) for i in range(n)))
    finally:
        stats = pool.snapshot()
        await pool.close()
    return {
        "lat": lat,
        "errors": errors,
        "warm_s": warm_s,
        "cold_starts": stats.cold_starts,
        "create_failures": stats.create_failures,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    n_conc = args.concurrent or (16 if args.quick else 64)
    seconds = args.seconds or (8.0 if args.quick else 30.0)
    n_lat = args.execs or (60 if args.quick else 200)
    if args.backend != "process" and args.image == DEFAULT_IMAGE:
        await build(say=lambda s: Console(stderr=True).print(s))
    backend = await choose_backend(args.backend, image=args.image, pool="bench")
    name = backend.name
    try:
        lat, cold = await _latency(backend, n_lat)
        conc = await _concurrent(backend, n_conc, seconds)
    finally:
        await backend.close()
    cl = conc["lat"]
    return {
        "benchmark": "sandbox",
        "backend": name,
        "image": args.image if name == "docker" else None,
        "exec_p50_ms": _pct(lat, 50),
        "exec_p99_ms": _pct(lat, 99),
        "cold_first_exec_p50_ms": _pct(cold, 50),
        "cold_over_warm_p50": round(float(np.median(cold) / np.median(lat)), 2),
        "concurrent": n_conc,
        "errors": len(conc["errors"]) + conc["create_failures"],
        "error_samples": conc["errors"][:5],
        "sustained_s": seconds,
        "concurrent_execs": len(cl),
        "concurrent_execs_per_s": round(len(cl) / seconds, 1),
        "concurrent_exec_p50_ms": _pct(cl, 50),
        "concurrent_exec_p99_ms": _pct(cl, 99),
        "warm_pool_fill_s": round(conc["warm_s"], 1),
        "cold_starts_during_run": conc["cold_starts"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = asyncio.run(_main(args))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    t = Table(title=f"Sandboxes ({out['backend']}): python3 -c pass in warm sandboxes")
    for c in ("exec p50 ms", "exec p99 ms", "cold first exec p50 ms", "cold / warm"):
        t.add_column(c, justify="right")
    t.add_row(
        str(out["exec_p50_ms"]),
        str(out["exec_p99_ms"]),
        str(out["cold_first_exec_p50_ms"]),
        f"{out['cold_over_warm_p50']}x",
    )
    Console().print(t)
    t = Table(title=f"{out['concurrent']} sandboxes busy for {out['sustained_s']:.0f} s")
    for c in ("execs", "execs/s", "p50 ms", "p99 ms", "errors", "pool fill s"):
        t.add_column(c, justify="right")
    t.add_row(
        str(out["concurrent_execs"]),
        str(out["concurrent_execs_per_s"]),
        str(out["concurrent_exec_p50_ms"]),
        str(out["concurrent_exec_p99_ms"]),
        str(out["errors"]),
        str(out["warm_pool_fill_s"]),
    )
    Console().print(t)
    return out


BENCHMARK = Benchmark("sandbox", "warm-pool exec latency and concurrent sandboxes", add_arguments, run)

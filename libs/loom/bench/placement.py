"""``loom bench placement``: time and quality of Heddle's presorted DP placement.

Lengths are SWE-bench trajectory lengths (bootstrapped from the traces), workers are Qwen3-14B on H100 with
the engine model's interference. Reports the solver's median time (paper: 36-42 ms at n = 6400, m = 16),
the Formula 3 DP's time on the same instance, and the makespan against round-robin and least-load (LPT)
placement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from loom.bench.registry import Benchmark
from loom.bench.workloads import profile, swe_lengths
from loom.policies.partition import Partition, WorkerProfile, presorted_dp


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=6400, help="trajectories")
    p.add_argument("--m", type=int, default=16, help="workers")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--seed", type=int, default=0)


def _makespan(lengths: np.ndarray, assign: np.ndarray, workers: list[WorkerProfile]) -> float:
    worst = 0.0
    for w, prof in enumerate(workers):
        mine = lengths[assign == w]
        if len(mine):
            worst = max(worst, float(mine.max() * prof.per_token_s * prof.factor(np.array([len(mine)]))[0]))
    return worst


def _lpt(lengths: np.ndarray, workers: list[WorkerProfile]) -> np.ndarray:
    """Least-load greedy: longest first onto the worker with the least work so far."""
    load = np.zeros(len(workers))
    out = np.empty(len(lengths), dtype=np.int64)
    for i in np.argsort(-lengths):
        w = int(np.argmin(load))
        out[i] = w
        load[w] += lengths[i]
    return out


def _timed(fn: Any, repeats: int) -> tuple[list[float], Partition]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append((time.perf_counter() - t0) * 1000)
    assert result is not None
    return times, result


def measure(n: int, m: int, model: str, gpu: str, repeats: int, seed: int, dp_repeats: int) -> dict[str, Any]:
    lengths = swe_lengths(n, seed)
    workers = [profile(model, gpu, 1, n)] * m
    times, part = _timed(lambda: presorted_dp(lengths, workers), repeats)
    dp_times, dp_part = _timed(lambda: presorted_dp(lengths, workers, method="dp"), dp_repeats)
    rr = _makespan(lengths, np.arange(n) % m, workers)
    lpt = _makespan(lengths, _lpt(lengths, workers), workers)
    med = statistics.median(times)
    return {
        "n": n,
        "m": m,
        "median_ms": round(med, 3),
        "p99_ms": round(float(np.percentile(times, 99)), 3),
        "formula3_dp_median_ms": round(statistics.median(dp_times), 2),
        "speedup_vs_formula3_dp": round(statistics.median(dp_times) / med, 1),
        "paper_ms": [36, 42],
        "same_makespan_as_dp": bool(abs(part.makespan - dp_part.makespan) <= 1e-9 * dp_part.makespan),
        "makespan_s": {
            "presorted_dp": round(part.makespan, 1),
            "round_robin": round(rr, 1),
            "lpt": round(lpt, 1),
        },
        "makespan_ratio": {"round_robin": round(rr / part.makespan, 3), "lpt": round(lpt / part.makespan, 3)},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.n < 1 or args.m < 1:
        raise SystemExit("loom bench placement: --n and --m must be positive")
    n = min(args.n, 800) if args.quick else args.n
    repeats = 5 if args.quick else args.repeats
    result = measure(n, args.m, args.model, args.gpu, repeats, args.seed, dp_repeats=1 if args.quick else 3)
    result["m64"] = measure(n, 64, args.model, args.gpu, repeats, args.seed, dp_repeats=1)
    _print(result)
    return result


def _print(r: dict[str, Any]) -> None:
    t = Table(title=f"Presorted DP placement, n = {r['n']}")
    for c in ("m", "median ms", "p99 ms", "Formula 3 DP ms", "vs round robin", "vs LPT"):
        t.add_column(c, justify="right")
    for row in (r, r["m64"]):
        t.add_row(
            str(row["m"]),
            f"{row['median_ms']:.2f}",
            f"{row['p99_ms']:.2f}",
            f"{row['formula3_dp_median_ms']:.1f}",
            f"{row['makespan_ratio']['round_robin']:.2f}x",
            f"{row['makespan_ratio']['lpt']:.2f}x",
        )
    Console().print(t)


BENCHMARK = Benchmark(
    "placement", "Heddle's presorted DP placement: solver time and makespan vs baselines", add_arguments, run
)

"""``loom bench resources``: sort-initialised simulated annealing over model-parallel sizes.

Qwen3-14B on H100 with TP 1, 2, 4 or 8 per worker; SWE-bench lengths. Reports the annealer's time (paper:
about 5 s at 64 GPUs), its makespan against exhaustive search (at full size, and on small instances over
several seeds) and against the fixed MP 1 and MP 8 baselines.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.registry import Benchmark
from loom.bench.workloads import profile, swe_lengths
from loom.policies.resources import ResourceProblem, anneal, count_states, exhaustive, fixed

DEGREES = (1, 2, 4, 8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--n", type=int, default=1600, help="trajectories")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--seed", type=int, default=0)


def _problem(n: int, gpus: int, model: str, gpu: str, seed: int) -> ResourceProblem:
    profiles = {d: profile(model, gpu, d, n) for d in DEGREES}
    return ResourceProblem(swe_lengths(n, seed), gpus, profiles)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.gpus < 1 or args.n < 1:
        raise SystemExit("loom bench resources: --gpus and --n must be positive")
    n = min(args.n, 400) if args.quick else args.n
    problem = _problem(n, args.gpus, args.model, args.gpu, args.seed)
    t0 = time.perf_counter()
    got = anneal(problem, seed=args.seed)
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "gpus": args.gpus,
        "n": n,
        "seconds": round(seconds, 3),
        "paper_seconds": 5,
        "degrees": list(got.degrees),
        "makespan_s": round(got.makespan, 1),
        "evaluations": got.evaluations,
        "states": count_states(args.gpus, DEGREES),
    }
    for d in (1, 8):
        if args.gpus % d == 0:
            base = fixed(problem, d)
            result[f"fixed_{d}_makespan_s"] = round(base.makespan, 1)
            result[f"speedup_vs_fixed_{d}"] = round(base.makespan / got.makespan, 3)
    if result["states"] <= 2000 and not args.quick:
        best = exhaustive(_problem(n, args.gpus, args.model, args.gpu, args.seed))
        result["gap_to_exhaustive_full"] = round(got.makespan / best.makespan - 1, 4)
    gaps = []
    for seed in range(3 if args.quick else 8):
        small = _problem(200, 16, args.model, args.gpu, seed)
        best = exhaustive(_problem(200, 16, args.model, args.gpu, seed))
        gaps.append(anneal(small, seed=seed).makespan / best.makespan - 1)
    result["gap_to_exhaustive"] = round(max(gaps), 4)
    result["small_instances"] = {"gpus": 16, "n": 200, "seeds": len(gaps)}
    _print(result)
    return result


def _print(r: dict[str, Any]) -> None:
    t = Table(title=f"Resource allocation, {r['gpus']} GPUs, n = {r['n']}")
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("annealing time", f"{r['seconds']:.3f} s (paper: about 5 s)"),
        ("degrees", " ".join(map(str, r["degrees"]))),
        ("makespan", f"{r['makespan_s']:.0f} s"),
        ("vs fixed MP 1", f"{r.get('speedup_vs_fixed_1', float('nan')):.2f}x"),
        ("vs fixed MP 8", f"{r.get('speedup_vs_fixed_8', float('nan')):.2f}x"),
        ("gap to exhaustive (small)", f"{r['gap_to_exhaustive']:.2%}"),
    ]
    if "gap_to_exhaustive_full" in r:
        rows.append(("gap to exhaustive (full)", f"{r['gap_to_exhaustive_full']:.2%}"))
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)


BENCHMARK = Benchmark(
    "resources",
    "Heddle's simulated annealing over model-parallel sizes vs exhaustive and fixed MP",
    add_arguments,
    run,
)

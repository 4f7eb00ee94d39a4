"""``loom bench rollmux``: RollMux's co-scheduler (§7.4-7.5) against its baselines, in virtual time.

- Trace replay: jobs arrive at the creation times of a window of the openb GPU pod trace (or Poisson), run
  for Philly durations (or the pods' own lifetimes), with Table 6 phase profiles and SLOs from U(1, 2),
  groups of at most 5, under Loom (Algorithm 1 + round robin), solo disaggregation, random and most-idle.
  Reported: average and peak cost ($/h), SLO attainment, saving against solo disaggregation.
- Small instances: Loom's online placements against the brute-force offline optimum.
- Decision latency with 100, 1,000 and 2,000 resident jobs (paper Table 5).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.harness.cosched import MODELS, decision_latency, execute_group, make_arrivals, simulate
from loom.bench.registry import Benchmark
from loom.bench.rollmux_optimum import optimal_cost
from loom.bench.rollmux_plots import GanttRow, cost_and_gpus, gantt
from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.intergroup import (
    CoScheduler,
    MostIdle,
    Policy,
    RandomPlacement,
    RollMux,
    SoloDisaggregation,
)
from loom.policies.rollmux.job import WORKLOADS, sample_job
from loom.policies.rollmux.roundrobin import TRAIN_POOL

PAPER = {"saving_vs_solo": 1.84, "cost_over_optimal": 1.06, "decision_ms_2000": 591.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=None, help="jobs in the trace replay (default 300, quick 100)")
    p.add_argument("--workload", default="mixed", choices=WORKLOADS)
    p.add_argument("--arrivals", default="openb", choices=("openb", "poisson"))
    p.add_argument("--durations", default="philly", choices=("philly", "openb"))
    p.add_argument(
        "--model",
        default="duration",
        choices=MODELS,
        help="duration: jobs stay their trace duration (the paper's replay); "
        "iterations: jobs run a fixed number of iterations, so slowdowns cost time",
    )
    p.add_argument("--max-group", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/rollmux"), help="where the plots go")


def run(args: argparse.Namespace) -> dict[str, Any]:
    wall0 = time.perf_counter()
    cluster = ClusterSpec(max_group_size=args.max_group)
    n_jobs = args.jobs or (100 if args.quick else 300)
    arrivals = make_arrivals(
        n_jobs,
        random.Random(args.seed),
        workload=args.workload,
        arrivals=args.arrivals,
        durations=args.durations,
    )
    policies: list[Policy] = [RollMux(), SoloDisaggregation(), RandomPlacement(args.seed), MostIdle()]
    outcomes = {p.name: simulate(arrivals, cluster, p, args.model) for p in policies}
    t0 = arrivals[0].t
    horizon = max(o.end for o in outcomes.values()) - t0
    solo = outcomes["solo"].dollars
    instances, size = 60, 8  # under a second: the same in --quick
    opt = _versus_optimal(cluster, args.workload, instances, size, args.seed)
    latency = {
        str(n): decision_latency(cluster, n, args.seed, samples=5 if args.quick else 20)
        for n in (100, 1000, 2000)
    }
    args.out.mkdir(parents=True, exist_ok=True)
    plots = [
        str(cost_and_gpus(args.out / "cost_gpus.png", outcomes, t0)),
        str(_group_gantt(args.out / "gantt.png", cluster, args.workload, args.seed)),
    ]
    out: dict[str, Any] = {
        "benchmark": "rollmux",
        "workload": args.workload,
        "jobs": n_jobs,
        "arrivals": args.arrivals,
        "durations": args.durations,
        "model": args.model,
        "max_group": args.max_group,
        "horizon_h": round(horizon / 3600.0, 1),
        "cost_per_hour": {n: round(o.cost_per_hour(horizon), 1) for n, o in outcomes.items()},
        "peak_cost": {n: round(o.peak_cost, 1) for n, o in outcomes.items()},
        "slo_attainment": {n: round(o.slo_attainment, 4) for n, o in outcomes.items()},
        "saving_vs_solo": {n: round(solo / o.dollars, 3) for n, o in outcomes.items()},
        "mean_slowdown": {n: round(statistics.fmean(o.slowdowns), 3) for n, o in outcomes.items()},
        "cost_over_optimal": opt["mean"],
        "optimal": opt,
        "decision_ms": {n: round(v["median_ms"], 3) for n, v in latency.items()},
        "decision": {n: {k: round(x, 3) for k, x in v.items()} for n, v in latency.items()},
        "paper": PAPER,
        "plots": plots,
        "wall_s": round(time.perf_counter() - wall0, 1),
    }
    _print(out)
    return out


def _versus_optimal(
    cluster: ClusterSpec, workload: str, instances: int, size: int, seed: int
) -> dict[str, Any]:
    """Loom's online placements of ``size`` co-resident jobs (in arrival order) against the offline optimum
    (any grouping, pinning and order, training pools sized by a member's request as in Loom)."""
    ratios, loom_total, opt_total = [], 0.0, 0.0
    t0 = time.perf_counter()
    for i in range(instances):
        rng = random.Random(seed * 1000 + i)
        jobs = [sample_job(f"s{i}-{k}", workload, rng) for k in range(size)]
        state = CoScheduler(cluster, RollMux())
        for j in jobs:
            state.submit(j)
        online, best = state.cost(), optimal_cost(jobs, cluster)
        ratios.append(online / best)
        loom_total += online
        opt_total += best
    return {
        "instances": instances,
        "jobs_per_instance": size,
        "mean": round(statistics.fmean(ratios), 4),
        "max": round(max(ratios), 4),
        "at_optimum": sum(r <= 1 + 1e-9 for r in ratios),
        "ratio_of_totals": round(loom_total / opt_total, 4),
        "search_s": round(time.perf_counter() - t0, 1),
    }


def _group_gantt(path: Path, cluster: ClusterSpec, workload: str, seed: int) -> Path:
    """Three meta-iterations of the largest group Loom forms from 20 co-resident jobs, as executed by the
    live round-robin executor."""
    rng = random.Random(seed)
    state = CoScheduler(cluster, RollMux())
    for k in range(20):
        state.submit(sample_job(f"j{k}", workload, rng))
    g = max(state.groups.values(), key=lambda g: (len(g.members), -g.id))
    names = list(g.members)
    rows: list[GanttRow] = []
    for k, phase, resources, start, end in execute_group(g.phases(), 3):
        for r in resources:
            lane = "train" if r == TRAIN_POOL else f"rollout node {r}"
            rows.append((lane, names[k], phase, start, end))
    title = f"Group {g.id}: {', '.join(names)}; meta-iteration {g.period():.0f} s (longest solo {g.t_cycle:.0f} s)"
    return gantt(path, rows, title)


def _print(out: dict[str, Any]) -> None:
    t = Table(
        title=f"Co-scheduling {out['jobs']} {out['workload']} jobs over {out['horizon_h']} h ({out['model']} model)"
    )
    for c in ("policy", "avg $/h", "peak $/h", "SLO met", "saving vs solo", "mean slowdown"):
        t.add_column(c, justify="right")
    for n in out["cost_per_hour"]:
        t.add_row(
            n,
            f"{out['cost_per_hour'][n]:,.0f}",
            f"{out['peak_cost'][n]:,.0f}",
            f"{out['slo_attainment'][n]:.0%}",
            f"{out['saving_vs_solo'][n]:.2f}x",
            f"{out['mean_slowdown'][n]:.2f}",
        )
    Console().print(t)
    o = out["optimal"]
    Console().print(
        f"Against the offline optimum ({o['instances']} instances of {o['jobs_per_instance']} jobs): "
        f"mean {o['mean']:.3f}x, max {o['max']:.2f}x, {o['at_optimum']} at the optimum (paper: 1.06x)"
    )
    Console().print(
        "Decision latency (median ms): "
        + ", ".join(f"{n} jobs {ms:.2f}" for n, ms in out["decision_ms"].items())
        + " (paper: 591 ms at 2,000)"
    )


BENCHMARK = Benchmark(
    "rollmux", "RollMux co-scheduling of RL jobs against solo, random, most-idle, optimum", add_arguments, run
)

"""``loom bench envs``: RollArt's environment experiments (§7.4, Figure 12) in virtual time.

Tool use (tau-bench airline) trajectories with Qwen3-8B on 8 H100s, the way RollArt ran Qwen3-8B/32K:

- trajectory-level vs batch-level environment interaction with an injected per-call latency N(10 s, sigma)
  for sigma 1..10; the ratio is batch-level rollout time over trajectory-level (RollArt: 1.23x to 2.27x);
- redundant environment rollouts: with a share of fail-slow and fail-stop environments, launching extra
  groups and stopping at the needed number, against exactly that many with timeouts and reruns.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.harness.cluster import Cluster
from loom.bench.harness.envs import Faults, interaction_speedup, redundancy_speedup, with_latency
from loom.bench.registry import Benchmark
from loom.protocol import PolicySpec
from loom.workloads import WORKLOADS

PAPER_SPEEDUP_SIGMA10 = 2.27


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--policy", default="slime", help="the rollout policy both modes run under")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default=None, help="a tau-bench trace file of the same schema")


def run(args: argparse.Namespace) -> dict[str, Any]:
    wall0 = time.perf_counter()
    # The whole trace set takes seconds, so --quick runs it too: a smaller batch would understate the
    # barrier (the slowest of fewer latency draws).
    workload = WORKLOADS["tool_use"](prompts=None, group_size=4, seed=args.seed, path=args.traces)
    cluster = Cluster(gpus=args.gpus, model=args.model, tool_s=10.0)
    policy = PolicySpec(preset=args.policy).resolved()
    sigmas = tuple(range(1, 11))
    interaction: dict[str, dict[str, float]] = {}
    for sigma in sigmas:
        interaction[str(sigma)] = interaction_speedup(workload, policy, cluster, float(sigma), seed=args.seed)
    # tau-bench holds 4 trials per task: GRPO groups of 3 are the target, the fourth trial is the spare
    # sample, and a fifth of the tasks are spare groups. Environments keep the injected N(10, 5) latency.
    slow = with_latency(workload, 10.0, 5.0, args.seed)
    extra = max(1, workload.groups // 5)
    groups = workload.groups - extra
    redundant = redundancy_speedup(slow, policy, cluster, groups, 3, extra, 1, Faults(), seed=args.seed)
    out: dict[str, Any] = {
        "benchmark": "envs",
        "workload": "tool_use",
        "model": args.model,
        "gpus": args.gpus,
        "trajectories": len(workload.trajectories),
        "trajectory_vs_batch_speedup": {k: round(v["speedup"], 3) for k, v in interaction.items()},
        "redundant_speedup": None if redundant["speedup"] is None else round(redundant["speedup"], 3),
        "paper_speedup_sigma10": PAPER_SPEEDUP_SIGMA10,
        "interaction": {k: {n: round(x, 1) for n, x in v.items()} for k, v in interaction.items()},
        "redundancy": {
            "groups_needed": groups,
            "samples_needed": 3,
            "extra_groups": extra,
            "extra_samples": 1,
            "faults": dataclasses.asdict(Faults()),
            **{k: None if v is None else round(v, 2) for k, v in redundant.items()},
        },
        "wall_s": round(time.perf_counter() - wall0, 1),
    }
    _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    t = Table(
        title=f"Environment interaction: tool_use, {out['model']}, {out['gpus']} GPUs, latency N(10, sigma)"
    )
    for c in ("sigma", "trajectory-level s", "batch-level s", "speedup"):
        t.add_column(c, justify="right")
    for sigma, r in out["interaction"].items():
        t.add_row(sigma, f"{r['trajectory_s']:,.0f}", f"{r['batch_s']:,.0f}", f"{r['speedup']:.2f}x")
    Console().print(t)
    r = out["redundancy"]
    Console().print(
        f"Redundant environments: {r['groups_needed']} groups of {r['samples_needed']}, "
        f"+{r['extra_groups']} groups, +{r['extra_samples']} sample each: "
        f"{r['baseline_s']} s -> {r['redundant_s']} s (speedup {out['redundant_speedup']})"
    )


BENCHMARK = Benchmark(
    "envs", "trajectory- vs batch-level environments, redundant rollouts", add_arguments, run
)

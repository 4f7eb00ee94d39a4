"""``loom bench async``: RollArt's asynchronous training (§7.2, §7.4) in virtual time, whole training steps.

A multi-task batch (coding, search, tool use in a uniform ratio, 8 samples per prompt, 32K context) trains on
32 H800 while the rest of the cluster generates (``loom.bench.harness.training``), under three modes of the same
loop: synchronous (veRL), one-off (StreamRL) and Loom's asynchronous loop with bound alpha = 1..6 in RollArt's
workflow order (each update reaches the fleet when the trainer takes its next batch; pushing it as soon as it is
made is the ``async-1-eager`` ablation). Qwen3-8B,
14B and 32B at RollArt's rollout tensor parallelism (1, 2, 4). Reported per model and mode: step time and what
it is made of (waiting for the batch, training, weight sync), the aborted fraction, the batch's task mix;
the speedups of alpha = 1 over sync and one-off (8B unless stated), against the paper's 2.05x and 1.35x
(reported for Qwen3-32B).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.harness.training import Mode, Pool
from loom.bench.registry import Benchmark
from loom.bench.training_cells import TP, Cell, add_run_arguments, run_cells, run_plan
from loom.engine.model.train_perf import MFU

PAPER = {"speedup_vs_sync": 2.05, "speedup_vs_oneoff": 1.35, "best_alpha_over_1": 1.22}


QUICK = (8, 3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, "async", QUICK)
    p.add_argument("--alphas", default="1,2,3,4,5,6")
    p.add_argument("--rollout-gpus", type=int, default=96, help="H800 GPUs that generate (training has 32)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    wall0 = time.perf_counter()
    models, steps, warmup = run_plan(args, QUICK)
    alphas = [1, 2] if args.quick else [int(a) for a in args.alphas.split(",")]
    # Ablation: the same loop with each update pushed as soon as it is made (the bound one update stricter).
    modes = [
        Mode.sync(),
        Mode.one_off(),
        *(Mode.asynchronous(a) for a in alphas),
        Mode.asynchronous(1, False),
    ]
    cells = [
        Cell(
            m,
            mode,
            (Pool("h800", args.rollout_gpus, TP[m], "rdma"),),
            32,
            args.batch_groups,
            steps,
            warmup,
            args.seed,
        )
        for m in models
        for mode in modes
    ]
    rows = run_cells(cells, args.workers)
    by = {(r["model"], r["mode"]): r for r in rows}
    per_model: dict[str, Any] = {}
    for m in models:
        sync, oneoff, a1 = by[(m, "sync")], by[(m, "one-off")], by[(m, "async-1")]
        eager = by[(m, "async-1-eager")]
        # By trained tokens per second: a larger bound trains shorter batches, so step time alone flatters it.
        best = max((by[(m, f"async-{a}")] for a in alphas), key=lambda r: r["trained_tokens_per_s"])
        per_model[m] = {
            "step_time_s": {r["mode"]: r["step_time_s"] for r in rows if r["model"] == m},
            "speedup_vs_sync": round(sync["step_time_s"] / a1["step_time_s"], 3),
            "speedup_vs_oneoff": round(oneoff["step_time_s"] / a1["step_time_s"], 3),
            "oneoff_vs_sync": round(sync["step_time_s"] / oneoff["step_time_s"], 3),
            "policy_lag_max": {r["mode"]: r["policy_lag_max"] for r in rows if r["model"] == m},
            "eager_vs_sync": round(sync["step_time_s"] / eager["step_time_s"], 3),
            "eager_vs_oneoff": round(oneoff["step_time_s"] / eager["step_time_s"], 3),
            "tokens_per_s_vs_sync": round(a1["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 3),
            "tokens_per_s_vs_oneoff": round(a1["trained_tokens_per_s"] / oneoff["trained_tokens_per_s"], 3),
            "best_alpha": best["alpha"],
            "best_alpha_over_1": round(a1["step_time_s"] / best["step_time_s"], 3),
            "best_alpha_tokens_over_1": round(best["trained_tokens_per_s"] / a1["trained_tokens_per_s"], 3),
            "aborted_fraction": {str(a): by[(m, f"async-{a}")]["aborted_fraction"] for a in alphas},
            "eager_aborted_fraction": eager["aborted_fraction"],
            "limited_by": {r["mode"]: r["limited_by"] for r in rows if r["model"] == m},
            # Bound 1 never trained faster than its update and sync: the speedups that would leave.
            "ceiling_vs_sync": round(sync["step_time_s"] / (a1["train_s"] + a1["sync_s"]), 3),
            "ceiling_vs_oneoff": round(oneoff["step_time_s"] / (a1["train_s"] + a1["sync_s"]), 3),
        }
    head = per_model[models[0]]
    out: dict[str, Any] = {
        "benchmark": "async",
        "setup": {
            "workload": "coding+search+tool_use, uniform, group 8, 32K context",
            "batch_groups": args.batch_groups,
            "train": "32 x h800",
            "rollout": f"{args.rollout_gpus} x h800",
            "mfu": MFU,
            "steps": steps,
            "warmup": warmup,
        },
        "model": models[0],
        "step_time_s": head["step_time_s"],
        "speedup_vs_sync": head["speedup_vs_sync"],
        "speedup_vs_oneoff": head["speedup_vs_oneoff"],
        "aborted_fraction": head["aborted_fraction"],
        "models": per_model,
        "runs": rows,
        "paper": PAPER,
    }
    out["target"] = {
        "speedup_vs_sync": PAPER["speedup_vs_sync"],
        "speedup_vs_oneoff": PAPER["speedup_vs_oneoff"],
        "met": head["speedup_vs_sync"] >= PAPER["speedup_vs_sync"]
        and head["speedup_vs_oneoff"] >= PAPER["speedup_vs_oneoff"],
    }
    if not args.no_plots:
        from loom.bench.async_report import write_report

        out["report"] = str(write_report(args.out, out))
    out["wall_s"] = round(time.perf_counter() - wall0, 1)
    _print(out)
    return out


def _print(out: dict[str, Any]) -> None:
    c = Console()
    for m, pm in out["models"].items():
        t = Table(
            title=f"{m}: step time per mode ({out['setup']['train']} train, {out['setup']['rollout']} rollout)"
        )
        for col in (
            "mode",
            "step s",
            "wait s",
            "train s",
            "sync s",
            "lag",
            "trained tok/s",
            "aborted",
            "coding",
            "limited by",
        ):
            t.add_column(col, justify="right")
        for r in out["runs"]:
            if r["model"] != m:
                continue
            t.add_row(
                r["mode"],
                f"{r['step_time_s']:.1f}",
                f"{r['wait_s']:.1f}",
                f"{r['train_s']:.1f}",
                f"{r['sync_s']:.1f}",
                str(r["policy_lag_max"]),
                f"{r['trained_tokens_per_s']:,}",
                f"{r['aborted_fraction']:.1%}",
                f"{r['batch_mix'].get('coding', 0.0):.1%}",
                r["limited_by"],
            )
        c.print(t)
        c.print(
            f"alpha 1: {pm['speedup_vs_sync']:.2f}x sync (paper 2.05x), {pm['speedup_vs_oneoff']:.2f}x one-off "
            f"(paper 1.35x); per trained token {pm['tokens_per_s_vs_sync']:.2f}x and {pm['tokens_per_s_vs_oneoff']:.2f}x; "
            f"one-off {pm['oneoff_vs_sync']:.2f}x sync (paper 1.52x); best alpha "
            f"{pm['best_alpha']} (most trained tokens/s): step {pm['best_alpha_over_1']:.2f}x, tokens/s "
            f"{pm['best_alpha_tokens_over_1']:.2f}x alpha 1 (paper: at most 1.22x); ablation, each update pushed "
            f"as soon as it is made: {pm['eager_vs_sync']:.2f}x sync, {pm['eager_vs_oneoff']:.2f}x one-off"
        )


BENCHMARK = Benchmark(
    "async", "RollArt asynchronous training: sync, one-off and bound 1..6 per step", add_arguments, run
)

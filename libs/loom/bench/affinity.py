"""``loom bench affinity``: RollArt §7.3's hardware affinity in virtual time, whole training steps.

Training is fixed on 32 H800; three rollout configurations of about equal cost (an H800 costs 2.85 H20,
RollArt Table 2): 72 H800, 208 H20, and 64 H800 + 24 H20 with ``{"coding": "h800", "default": "h20"}`` (the
long-context coding agent on compute-rich GPUs, search and tool use on H20, as RollArt routes its math and
game tasks). H20 pools sit in another cluster: their weights come over TCP, H800's over RDMA, and they fetch
them on their own (the cross-cluster update of §5.2, part of RollArt's affinity). Each runs synchronously
(rollout then training, which isolates what the hardware does to the rollout, as §7.3 sets out to) and
asynchronously with bound 1. Reported: step times and their terms, the tail floor (the slowest trajectory of
each batch alone on its GPU), and the synchronous ``vs_h20_only`` and ``vs_h800_only`` of the affinity
configuration (8B unless stated), against the paper's 1.30-1.68x and 1.12-1.37x.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.harness.mapping import choose_affinity
from loom.bench.harness.training import Mode, Pool
from loom.bench.registry import Benchmark
from loom.bench.training_cells import TP, Cell, add_run_arguments, mix_workload, run_cells, run_plan

PAPER = {"vs_h20_only": (1.30, 1.68), "vs_h800_only": (1.12, 1.37)}
AFFINITY = (("coding", "h800"), ("default", "h20"))


def configs(model: str) -> dict[str, tuple[tuple[Pool, ...], tuple[tuple[str, str], ...]]]:
    tp = TP[model]
    return {
        "h800-only": ((Pool("h800", 72, tp, "rdma"),), ()),
        "h20-only": ((Pool("h20", 208, tp, "tcp"),), ()),
        "affinity": ((Pool("h800", 64, tp, "rdma"), Pool("h20", 24, tp, "tcp")), AFFINITY),
    }


QUICK = (6, 2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, "affinity", QUICK)


def run(args: argparse.Namespace) -> dict[str, Any]:
    wall0 = time.perf_counter()
    models, steps, warmup = run_plan(args, QUICK)
    modes = {"sync": Mode.sync().with_async_update(), "async-1": Mode.asynchronous(1).with_async_update()}
    cells = [
        Cell(m, mode, pools, 32, args.batch_groups, steps, warmup, args.seed, f"{name} {tag}", aff)
        for m in models
        for name, (pools, aff) in configs(m).items()
        for tag, mode in modes.items()
    ]
    # Loom's own mapping from the engine model (``loom.bench.harness.mapping``), run as a fourth configuration on
    # the affinity pools where it differs from RollArt's.
    mix = mix_workload(args.seed).trajectories
    chosen = {m: choose_affinity(mix, m, {"h800": TP[m], "h20": TP[m]}) for m in models}
    for m in models:
        mine = tuple(sorted(chosen[m].affinity.items()))
        if dict(mine) != dict(AFFINITY):
            pools = configs(m)["affinity"][0]
            cells += [
                Cell(m, mode, pools, 32, args.batch_groups, steps, warmup, args.seed, f"loom {tag}", mine)
                for tag, mode in modes.items()
            ]
    rows = run_cells(cells, args.workers)
    for row, c in zip(rows, cells, strict=True):
        row["config"], row["mode_tag"] = c.label.split(" ")
    by = {(r["model"], r["config"], r["mode_tag"]): r for r in rows}
    per_model: dict[str, Any] = {}
    for m in models:
        per_model[m] = {tag: _compare(by, m, tag) for tag in modes}
    head = per_model[models[0]]["sync"]
    out: dict[str, Any] = {
        "benchmark": "affinity",
        "model": models[0],
        "mode": "sync",
        "step_time_s": head["step_time_s"],
        "vs_h20_only": head["vs_h20_only"],
        "vs_h800_only": head["vs_h800_only"],
        "models": per_model,
        "chosen_affinity": {
            m: {"affinity": c.affinity, "same_as_paper": c.affinity == dict(AFFINITY), "why": c.reasons}
            for m, c in chosen.items()
        },
        "runs": rows,
        "paper": PAPER,
        "target": {
            "vs_h20_only": PAPER["vs_h20_only"][0],
            "vs_h800_only": PAPER["vs_h800_only"][0],
            "met": head["vs_h20_only"] >= PAPER["vs_h20_only"][0]
            and head["vs_h800_only"] >= PAPER["vs_h800_only"][0],
        },
    }
    if not args.no_plots:
        out["report"] = str(write_report(args.out, out))
    out["wall_s"] = round(time.perf_counter() - wall0, 1)
    _print(out)
    return out


def write_report(directory: Path, out: dict[str, Any]) -> Path:
    from loom.bench.async_report import terms_plot

    directory.mkdir(parents=True, exist_ok=True)
    plot = terms_plot(directory / "terms.png", out, "Step time and its terms per rollout configuration")
    lines = [
        "# RollArt hardware affinity in virtual time",
        "",
        "Training on 32 H800; rollout on 72 H800, 208 H20, or 64 H800 + 24 H20 with "
        '`{"coding": "h800", "default": "h20"}`; the coding + search + tool-use mix, 64 groups of 8 per batch.',
        "",
        "| model | configuration | mode | step s | waiting s | tail floor s | training s | sync s | largest term |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["runs"]:
        lines.append(
            f"| {r['model']} | {r['config']} | {r['mode_tag']} | {r['step_time_s']:.1f} | {r['wait_s']:.1f} | "
            f"{r['tail_floor_s']:.1f} | {r['train_s']:.1f} | {r['sync_s']:.1f} | {r['limited_by']} |"
        )
    lines += [
        "",
        "| model | mode | vs H20-only (paper 1.30-1.68x) | vs H800-only (paper 1.12-1.37x) | waiting for the batch "
        "vs H20-only, H800-only | training and sync in the step |",
        "|---|---|---|---|---|---|",
    ]
    for m, pm in out["models"].items():
        for tag, v in pm.items():
            lines.append(
                f"| {m} | {tag} | {v['vs_h20_only']:.2f}x | {v['vs_h800_only']:.2f}x | "
                f"{v['rollout_vs_h20_only']}x, {v['rollout_vs_h800_only']}x | {v['fixed_share']:.0%} |"
            )
    lines += [
        "",
        "The affinity acts on the rollout (waiting for the batch); training and weight sync run on the same 32 "
        "H800 in every configuration, so their share of the step bounds what the affinity can gain. The tail "
        "floor is the slowest trajectory of each batch alone on the GPU its task runs on (its calls and tool "
        "time, no other load): in the synchronous step the wait cannot fall below it, and the affinity leaves it "
        "where it was whenever that trajectory runs on H800 in both configurations.",
        "",
        "Loom's own mapping, chosen from the engine model (`loom.bench.harness.mapping`):",
        "",
    ]
    for m, c in out["chosen_affinity"].items():
        same = (
            "the same as RollArt's"
            if c["same_as_paper"]
            else "not RollArt's: run as the `loom` configuration"
        )
        lines.append(f"- {m}: `{json.dumps(c['affinity'])}`, {same}. " + "; ".join(c["why"]) + ".")
    lines += [
        "",
        f"![terms]({plot.name})",
        "",
    ]
    report = directory / "report.md"
    report.write_text("\n".join(lines))
    (directory / "results.json").write_text(json.dumps(out, indent=2))
    return report


def _compare(by: dict[tuple[str, str, str], dict[str, Any]], m: str, tag: str) -> dict[str, Any]:
    """Step-time ratios of the affinity configuration, and the same for the term hardware acts on (waiting for
    the batch); what is left of the step is training and weight sync, the same hardware in every
    configuration, so a short step ratio says which term holds it back."""
    aff = by[(m, "affinity", tag)]
    out: dict[str, Any] = {
        "step_time_s": {c: by[(m, c, tag)]["step_time_s"] for c in ("h800-only", "h20-only", "affinity")}
    }
    for base in ("h20-only", "h800-only"):
        b = by[(m, base, tag)]
        key = base.replace("-", "_")
        out[f"vs_{key}"] = round(b["step_time_s"] / aff["step_time_s"], 3)
        out[f"rollout_vs_{key}"] = round(b["wait_s"] / aff["wait_s"], 3) if aff["wait_s"] > 0 else None
    out["fixed_share"] = round((aff["train_s"] + aff["sync_s"]) / aff["step_time_s"], 3)
    out["tail_floor_s"] = {c: by[(m, c, tag)]["tail_floor_s"] for c in ("h800-only", "h20-only", "affinity")}
    out["limited_by"] = aff["limited_by"]
    return out


def _print(out: dict[str, Any]) -> None:
    c = Console()
    t = Table(title="Hardware affinity: 32 H800 train; rollout 72 H800 | 208 H20 | 64 H800 + 24 H20")
    for col in ("model", "config", "mode", "step s", "wait s", "floor s", "train s", "sync s", "limited by"):
        t.add_column(col, justify="right")
    for r in out["runs"]:
        t.add_row(
            r["model"],
            r["config"],
            r["mode_tag"],
            f"{r['step_time_s']:.1f}",
            f"{r['wait_s']:.1f}",
            f"{r['tail_floor_s']:.1f}",
            f"{r['train_s']:.1f}",
            f"{r['sync_s']:.1f}",
            r["limited_by"],
        )
    c.print(t)
    for m, pm in out["models"].items():
        for tag, v in pm.items():
            c.print(
                f"{m} {tag}: affinity {v['vs_h20_only']:.2f}x H20-only (paper 1.30-1.68x), "
                f"{v['vs_h800_only']:.2f}x H800-only (paper 1.12-1.37x); waiting for the batch "
                f"{v['rollout_vs_h20_only']}x and {v['rollout_vs_h800_only']}x; training and sync are "
                f"{v['fixed_share']:.0%} of its step ({v['limited_by']} is the largest term)"
            )


BENCHMARK = Benchmark(
    "affinity",
    "RollArt hardware affinity: H800-only, H20-only and mixed rollout per step",
    add_arguments,
    run,
)

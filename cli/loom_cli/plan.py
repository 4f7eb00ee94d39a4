"""``loom plan``: the layout, makespan and throughput Loom and each baseline would reach on a cluster, for a
built-in workload or a rollout-trace file, and the size beyond which it stops speeding up
(``loom.bench.plan``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench import plan as planner
from loom.bench.harness.cluster import Cluster, fixed_degree
from loom.bench.rollout import add_workload_arguments, replay_of
from loom.protocol import PRESETS


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="plan a cluster for a workload: layout, makespan per system, saturation")
    add_workload_arguments(p)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--out", type=Path, default=Path("bench-out/plan"), help="where the plot goes")
    p.add_argument("--json", action="store_true", help="end with one JSON line of every figure")


def run(args: argparse.Namespace) -> int:
    if args.step == "all":
        raise SystemExit("loom plan: one training step's batch (--step N), not all")
    # Checked before the workload loads and the predictor trains: every baseline runs on the size asked.
    try:
        for s in planner.SYSTEMS:
            fixed_degree(PRESETS[s], Cluster(gpus=args.gpus, model=args.model))
    except ValueError as e:
        raise SystemExit(f"loom plan: {e}") from None
    replay = replay_of(args)
    cluster = Cluster(gpus=args.gpus, gpu=args.gpu, model=args.model, tool_s=replay.tool_s)
    out = planner.plan(replay.workload, cluster, args.predictor, replay.learned, args.seed)
    out = {"workload": args.workload, **replay.source, **out, "predictor": replay.predictor}
    name = Path(args.workload).name.split(".")[0]
    png = args.out / f"plan-{name}-{args.model}-{args.gpu}-{args.gpus}.png"
    planner.plot(out, png, f"{name}, {args.model} on {args.gpu}")
    out["plot"] = str(png)
    _print(out)
    if args.json:
        print(json.dumps(out))
    return 0


def _print(out: dict[str, Any]) -> None:
    layout = ", ".join(f"{n} x MP{d}" for d, n in out["layout"]["degrees"].items())
    t = Table(title=f"Plan: {out['workload']}, {out['model']} on {out['gpus']} {out['gpu']} ({layout})")
    for c in ("system", "makespan s", "throughput tok/s", "tail share", "makespan / LB"):
        t.add_column(c, justify="right")
    for s, f in out["systems"].items():
        t.add_row(
            s,
            f"{f['makespan_s']:,.1f}",
            f"{f['throughput_tok_s']:,.0f}",
            f"{f['tail_share']:.0%}",
            f"{f['makespan_over_lb']:.2f}",
        )
    console = Console()
    console.print(t)
    sat = out["saturation_gpus"]
    console.print(
        f"critical path {out['critical_path_s']:,.1f} s: more than {sat['bound']} GPUs no longer shorten the bound "
        f"(measured: {_measured(sat['measured'])}); plot {out['plot']}"
    )


def _measured(gpus: int | None) -> str:
    return f"within 5% of the best from {gpus}" if gpus else "still faster at the sweep's largest size"

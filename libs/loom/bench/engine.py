"""``loom bench engine``: decode speed, per-token time and interference from the performance model, its error
on every published calibration point, against the iteration times measured on a GPU, and the virtual-time
driver's simulation speed.

Decode speed follows Qwen's benchmark: each of ``--batch`` sequences generates 2,048 tokens after a
``--context``-token prompt (1 by default); the published H20 speeds are its baselines. ``--sweep`` tabulates
per-token time and Heddle's interference factor F against batch size at ``--context`` tokens per sequence,
from the same table the placement policy reads.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.engine_calibration import (
    MEASURED,
    MEASURED_MODELS,
    POINTS,
    calibration_report,
    fit_measured,
    interference_errors,
    measured_points,
)
from loom.bench.registry import Benchmark
from loom.bench.sim_throughput import run_workload
from loom.engine.model.interference import context_bucket, interference_table
from loom.engine.model.perf import GPUS, MODELS, PerfModel

GENERATED = 2048
SWEEP_TPS = (1, 2, 4, 8)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-8b", choices=list(MODELS))
    p.add_argument("--gpu", default="h100", choices=list(GPUS))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    p.add_argument("--context", type=int, default=1, help="prompt tokens per sequence")
    p.add_argument(
        "--sweep", action="store_true", help="per-token time and F for batch 1..256, TP 1, 2, 4, 8"
    )
    p.add_argument(
        "--real",
        action="store_true",
        help="also a small Qwen3 on the transformers engine on this CPU: loom train's math rollouts, tokens/s",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="with --real: the same rollouts again on an engine that drafts (lossless speculative decoding)",
    )
    p.add_argument(
        "--model-path", default=None, help="with --real: a local checkpoint instead of the tiny policy"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="with --real: runs of each engine (default 3, quick 1)"
    )
    p.add_argument(
        "--throughput",
        action="store_true",
        help="simulated tokens per wall second of the virtual-time driver",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.tp < 1 or args.batch < 1 or args.context < 1:
        raise SystemExit("loom bench engine: --tp, --batch and --context must be positive")
    result = decode(args.model, args.gpu, args.tp, args.batch, args.context)
    result["calibration"] = calibration()
    result["measured"] = {gpu: measured(gpu) for gpu in MEASURED}
    if args.sweep:
        result["sweep"] = sweep(args.model, args.gpu, args.context)
    if args.throughput:
        trajectories = 400 if args.quick else 4000
        result["throughput"] = run_workload(8, trajectories, args.model, args.gpu, args.tp)
        result["sim_tokens_per_wall_s"] = result["throughput"]["sim_tokens_per_wall_s"]
    if args.speculative and not args.real:
        raise SystemExit("loom bench engine: --speculative measures the real engine; add --real")
    if args.real:
        # Imported here: it brings torch and transformers, which every other loom command starts without.
        from loom.bench.engine_real import real

        result["real"] = real(args.quick, args.speculative, args.model_path, repeats=args.repeats)
    _print_tables(result)
    return result


def decode(model: str, gpu: str, tp: int, batch: int, context: int) -> dict[str, Any]:
    perf = PerfModel(gpu, model, tp)

    def per_token(b: int) -> float:
        return perf.decode_span(b, b * context, GENERATED) / GENERATED

    # Qwen's protocol: a one-token prompt.
    published = next(
        (
            p.published
            for p in POINTS
            if p.quantity == "decode_tok_s"
            and (p.gpu, p.model, p.tp, p.x, 1) == (gpu, model, tp, batch, context)
        ),
        None,
    )
    tok_s = batch / per_token(batch)
    return {
        "benchmark": "engine",
        "model": model,
        "gpu": gpu,
        "tp": tp,
        "batch": batch,
        "context": context,
        "generated_tokens": GENERATED,
        "decode_tok_s": tok_s,
        "per_token_ms": per_token(batch) * 1e3,
        "interference": per_token(batch) / per_token(1),
        "published_decode_tok_s": published,
        "ratio": None if published is None else tok_s / published,
    }


def calibration() -> dict[str, Any]:
    points = [c.as_dict() for c in calibration_report()]
    return {"points": points, "max_abs_rel_error": max(abs(p["rel_error"]) for p in points)}


def measured(gpu: str) -> dict[str, Any]:
    """The model against the table measured on one ``gpu`` (loom/engine/model/measured): its interference factor,
    and how well its form fits the measured iteration times once its efficiencies are fitted to them."""
    eff, errors = fit_measured(gpu)
    return {
        "points": len(measured_points(gpu)),
        # A model with fewer than two measured batch sizes at one context (32B on an H100) has no F to compare.
        "interference_rel_error": {
            name: {"median": statistics.median(map(abs, e)), "max": max(map(abs, e))}
            for name, e in interference_errors(gpu).items()
            if e
        },
        "roofline_fit": {
            "models": list(MEASURED_MODELS),
            "compute": eff.compute,
            "memory": eff.memory,
            "exposed": eff.exposed,
            "overhead_ms": eff.overhead_s * 1e3,
            "median_abs_rel_error": statistics.median(map(abs, errors)),
            "max_abs_rel_error": max(map(abs, errors)),
        },
    }


def sweep(model: str, gpu: str, context: int) -> dict[str, Any]:
    tables = {tp: interference_table(model, gpu, tp, context) for tp in SWEEP_TPS}
    return {
        "context_bucket": context_bucket(context),
        "batches": list(SWEEP_BATCHES),
        "per_token_ms": {
            str(tp): [t.base_s * t.factor(b) * 1e3 for b in SWEEP_BATCHES] for tp, t in tables.items()
        },
        "interference": {str(tp): [t.factor(b) for b in SWEEP_BATCHES] for tp, t in tables.items()},
    }


def _print_tables(r: dict[str, Any]) -> None:
    console = Console(width=120)
    head = Table(title=f"{r['model']} on {r['tp']} x {r['gpu']}: batch {r['batch']}, prompt {r['context']}")
    for c in ("decode tok/s", "per-token ms", "F(batch)", "published tok/s", "ratio"):
        head.add_column(c, justify="right")
    published = r["published_decode_tok_s"]
    head.add_row(
        f"{r['decode_tok_s']:.1f}",
        f"{r['per_token_ms']:.2f}",
        f"{r['interference']:.2f}",
        "-" if published is None else f"{published:.1f}",
        "-" if r["ratio"] is None else f"{r['ratio']:.3f}",
    )
    console.print(head)

    cal = Table(title="Calibration: model vs published")
    for c in ("gpu", "model", "quantity", "x", "published", "predicted", "error"):
        cal.add_column(c, justify="right" if c in ("x", "published", "predicted", "error") else "left")
    for p in r["calibration"]["points"]:
        cal.add_row(
            p["gpu"],
            p["model"],
            p["quantity"],
            str(p["x"]),
            f"{p['published']:.1f}",
            f"{p['predicted']:.2f}",
            f"{p['rel_error']:+.1%}",
        )
    console.print(cal)

    for gpu, m in r["measured"].items():
        meas = Table(title=f"Heddle's F, model vs measured on {gpu} ({m['points']} iterations)")
        for c in ("model", "median |error|", "max |error|"):
            meas.add_column(c, justify="left" if c == "model" else "right")
        for name, e in m["interference_rel_error"].items():
            meas.add_row(name, f"{e['median']:.1%}", f"{e['max']:.1%}")
        console.print(meas)
        f = m["roofline_fit"]
        console.print(
            f"Roofline fitted to the measured {', '.join(f['models'])} on {gpu}: compute {f['compute']:.2f}, "
            f"memory {f['memory']:.2f}, exposed {f['exposed']:.2f}, overhead {f['overhead_ms']:.1f} ms; "
            f"|error| median {f['median_abs_rel_error']:.1%}, max {f['max_abs_rel_error']:.1%}"
        )

    if "sweep" in r:
        s = r["sweep"]
        for key, title, fmt in (
            ("per_token_ms", "Per-token ms", "{:.2f}"),
            ("interference", "Interference F", "{:.3f}"),
        ):
            t = Table(title=f"{title}, context {s['context_bucket']}")
            t.add_column("batch", justify="right")
            for tp in s[key]:
                t.add_column(f"TP {tp}", justify="right")
            for i, b in enumerate(s["batches"]):
                t.add_row(str(b), *(fmt.format(v[i]) for v in s[key].values()))
            console.print(t)

    if "real" in r:
        x = r["real"]
        t = Table(
            title=f"Transformers engine on this CPU ({x['threads']} threads): {x['tasks']} groups of {x['group']} "
            f"math trajectories, {x['policy']}"
        )
        for c in (
            "shape",
            "temperature",
            "engine",
            "tokens/s",
            "runs",
            "accepted/step",
            "drafting share",
            "kept",
        ):
            t.add_column(c, justify="right")
        for shape, temp, cell in ((s, k, c) for s, by_t in x["by_shape"].items() for k, c in by_t.items()):
            for name in ("plain", "drafting"):
                if name not in cell:
                    continue
                c = cell[name]
                t.add_row(
                    shape,
                    temp,
                    name,
                    f"{cell[name]['tokens_per_s']:.0f}",
                    str(len(cell[name]["runs"])),
                    f"{c['accepted_per_step']:.2f}" if "accepted_per_step" in c else "-",
                    f"{c['drafting_share']:.0%}" if "drafting_share" in c else "-",
                    f"{c['acceptance_rate']:.0%}" if "acceptance_rate" in c else "-",
                )
            if "speedup" in cell:
                t.add_row(shape, temp, "drafting / plain", f"{cell['speedup']:.2f}x", "", "", "", "")
        console.print(t)

    if "throughput" in r:
        th = r["throughput"]
        t = Table(title="Virtual-time driver: simulated tokens per wall second")
        for c in ("engines", "trajectories", "requests", "tokens", "sim s", "wall s", "tok/wall s", "vs 1M"):
            t.add_column(c, justify="right")
        t.add_row(
            str(th["engines"]),
            str(th["trajectories"]),
            str(th["requests"]),
            str(th["generated_tokens"]),
            f"{th['sim_makespan_s']:.0f}",
            f"{th['wall_s']:.2f}",
            f"{th['sim_tokens_per_wall_s']:.3g}",
            f"{th['ratio']:.2f}",
        )
        console.print(t)


BENCHMARK = Benchmark("engine", "performance model and simulated engine", add_arguments, run)

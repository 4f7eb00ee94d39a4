"""``loom predictor train|export``: build the length predictor's dataset, train it, export it to ONNX.

``train`` writes a checkpoint directory (config, weights, optimiser state for ``--resume``) and, unless told
not to, ``model.onnx`` beside it: by default where the predictor service looks (``$LOOM_HOME/predictor``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from loom.predict import default_model_path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("predictor", help="train and export the trajectory-length predictor")
    cmds = p.add_subparsers(dest="predictor_cmd", required=True)
    t = cmds.add_parser("train", help="train the regressor on recorded trajectories")
    t.add_argument(
        "--base", default="tiny", help="'tiny' (from a config, CPU) or a local Qwen3 checkpoint dir"
    )
    t.add_argument(
        "--traces",
        default=None,
        help="a trace file of the SWE schema (default: all three trace sets: coding, search, tool use)",
    )
    t.add_argument("--out", type=Path, default=default_model_path().parent, help="checkpoint directory")
    t.add_argument(
        "--steps",
        type=int,
        default=1500,
        help="optimiser steps in all (about ten minutes of two cores); the same on any machine",
    )
    t.add_argument("--epochs", type=int, default=30)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--limit", type=int, default=None, help="use only the first N trajectories")
    t.add_argument("--prompt-only", action="store_true", help="train on step 0 alone (the baseline)")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    t.add_argument("--no-export", action="store_true", help="skip the ONNX export")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(predictor_run=_train)
    e = cmds.add_parser("export", help="export a checkpoint directory to ONNX")
    e.add_argument("checkpoint", type=Path)
    e.add_argument("--out", type=Path, default=None, help="ONNX file (default: CHECKPOINT/model.onnx)")
    e.add_argument("--method", default="progressive")
    e.set_defaults(predictor_run=_export)


def run(args: argparse.Namespace) -> int:
    return int(args.predictor_run(args))


def _train(args: argparse.Namespace) -> int:
    from loom.data.trace_sets import SETS, trace_set, workload_of_prompts
    from loom.data.traces import load_traces
    from loom.predict import dataset, train
    from loom.predict.export import calibrate, export

    if args.traces is None:
        traces = [t for name in SETS for t in trace_set(name)][: args.limit]
    else:
        traces = list(load_traces(args.traces).values())[: args.limit]
    data = dataset.build(traces, steps=[0] if args.prompt_only else None, seed=args.seed)
    print(
        f"{len(traces)} trajectories: "
        + ", ".join(
            f"{k} {len({e.task_id for e in v})} prompts / {len(v)} examples" for k, v in data.items()
        ),
        file=sys.stderr,
    )
    cfg = train.TrainConfig(
        base=args.base,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        max_steps=args.steps,
        seed=args.seed,
    )
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TextColumn("step {task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("train", total=None, loss=float("nan"))

        def on_step(step: int, planned: int, loss: float) -> None:
            bar.update(task, completed=step, total=planned, loss=loss)

        report = train.train(data["train"], data["val"], cfg, args.out, resume=args.resume, on_step=on_step)
    summary = dict(vars(report))
    if not args.no_export:
        method = "prompt_only" if args.prompt_only else "progressive"
        onnx = export(args.out, args.out / "model.onnx", method)
        summary["onnx"] = str(onnx)
        first = [e for e in data["val"] if e.step == 0]
        if len(first) >= 2:  # the service weighs the model against a prompt's finished samples by it
            sets = workload_of_prompts()
            sd, slope = calibrate(onnx, first, [sets.get(e.task_id, "") for e in first])
            summary |= {"admission_log_sd": round(sd, 3), "admission_slope": round(slope, 3)}
        if not args.prompt_only:
            summary["combiner"] = _combine(onnx, {e.task_id for e in data["val"] + data["test"]}, args.seed)
    print(json.dumps(summary))
    return 0


def _combine(onnx: Path, held_out: set[str], seed: int) -> dict[str, str] | str:
    """Fit the combiner the service serves over the model (``loom.predict.combine``) on the prompts the
    model never saw, and write it into the model's metadata; the cells and what serves each, or why not."""
    from loom.bench.harness.served import fit_for_model
    from loom.predict.onnx_model import OnnxRegressor, meta_path

    try:
        combiner = fit_for_model(OnnxRegressor(onnx), held_out, seed=seed)
    except ValueError as e:
        print(f"no combiner: {e}; the service refines the model by finished siblings alone", file=sys.stderr)
        return str(e)
    meta = json.loads(meta_path(onnx).read_text())
    meta["combiner"] = combiner.to_json()
    meta_path(onnx).write_text(json.dumps(meta, indent=2))
    return combiner.chosen


def _export(args: argparse.Namespace) -> int:
    from loom.predict.export import export

    out = args.out or args.checkpoint / "model.onnx"
    print(export(args.checkpoint, out, args.method))
    return 0

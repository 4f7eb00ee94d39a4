"""``loom trace``: rollout-trace files (``loom.data.rollout_trace``): write a built-in workload in the schema,
check a file against it."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator

import msgspec

from loom.bench.harness.served import GROUP
from loom.data import importers
from loom.data import rollout_trace as rt
from loom.data.trace_sets import trace_set
from loom.protocol import Trajectory as Result
from loom.workloads import WORKLOADS, recorded


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="rollout-trace files: export a built-in workload, check a file")
    cmds = p.add_subparsers(dest="trace_cmd", required=True)
    e = cmds.add_parser("export", help="a built-in workload in the rollout-trace schema, with its text")
    e.add_argument("workload", choices=sorted(WORKLOADS))
    e.add_argument("--out", required=True, help="the file to write (.gz: gzip)")
    e.add_argument("--prompts", type=int, default=None, help="its first prompts only (default all)")
    e.add_argument("--group", type=int, default=None, help="samples per prompt (default the benchmarks')")
    e.add_argument("--seed", type=int, default=0)
    e.set_defaults(func=_export)
    i = cmds.add_parser("import", help="a trainer's rollout dump in the rollout-trace schema")
    i.add_argument("trainer", choices=sorted(importers.IMPORTERS))
    i.add_argument(
        "path",
        help="the dump, a directory or one file: verl's trainer.rollout_data_dir ({step}.jsonl), slime's"
        " --save-debug-rollout-data files (*.pt), SkyRL's trainer.export_path (dumped_data/*.pkl)",
    )
    i.add_argument("--out", required=True, help="the file to write (.gz: gzip)")
    i.set_defaults(func=_import)
    c = cmds.add_parser("check", help="validate a rollout-trace file and summarise it (JSON)")
    c.add_argument("path")
    c.set_defaults(func=_check)


def results_as_trace(lines: Iterable[bytes]) -> Iterator[bytes]:
    """A job's stored trajectories (NDJSON) as rollout-trace lines; those with no call are left out, counted
    on stderr."""
    results = [msgspec.json.decode(line, type=Result) for line in lines]
    trajectories, skipped = recorded.from_results(results)
    if skipped:
        print(f"loom results: {skipped} trajectories made no model call: not in the trace", file=sys.stderr)
    for t in trajectories:
        yield rt.dumps(t)


def _export(args: argparse.Namespace) -> int:
    w = WORKLOADS[args.workload](
        prompts=args.prompts, group_size=args.group or GROUP[args.workload], seed=args.seed
    )
    traces = {t.id: t for t in trace_set(args.workload)}
    n = rt.write(args.out, recorded.to_trace(w, 0, traces))
    print(json.dumps({"workload": args.workload, "trajectories": n, "groups": w.groups, "out": args.out}))
    return 0


def _import(args: argparse.Namespace) -> int:
    try:
        n = rt.write(args.out, list(importers.IMPORTERS[args.trainer](args.path)))
    except (ValueError, OSError) as e:
        print(f"loom trace import: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"trainer": args.trainer, "trajectories": n, "out": args.out}))
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        rec = recorded.load(args.path)
    except (ValueError, OSError) as e:
        print(f"loom trace check: {e}", file=sys.stderr)
        return 2
    summary = {
        "path": args.path,
        "schema": rt.SCHEMA,
        "steps": {
            str(s): {"trajectories": len(w.trajectories), "groups": w.groups} for s, w in rec.steps.items()
        },
        "turns": rec.turns,
        "turns_without_env_s": rec.turns_without_env_s,
        "text": rec.has_text,
        "mean_env_s": round(rec.mean_env_s(), 4),
    }
    print(json.dumps(summary))
    return 0

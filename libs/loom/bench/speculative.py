"""``loom bench speculative``: how many drafted tokens a model accepts per verification step, measured on the
recorded traces (``loom.bench.acceptance``), per workload, draft source and draft length.

Sources: the trajectory's own context (what vLLM's and SGLang's n-gram proposers draft from, the baseline
every ratio divides by), its group's siblings so far (Seer), the same task's earlier epoch (RhymeRL), a
corpus of other tasks' calls, and all four together. Each with the adaptive draft length; all four also with
fixed lengths 2, 4 and 8. Intervals are 95% bootstrap intervals over prompts.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.acceptance import SOURCES, measure, workload_cases
from loom.bench.registry import Benchmark
from loom.data.trace_sets import SETS

ALL = "all"
FIXED = (2, 4, 8)
# Prompts replayed per workload (None: every one). Coding's trajectories are long and one sample a task.
PROMPTS: dict[str, int | None] = {"coding": 100, "search": None, "tool_use": None}
QUICK_PROMPTS: dict[str, int | None] = {"coding": 6, "search": 16, "tool_use": 8}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(SETS)
    if unknown:
        raise SystemExit(
            f"loom bench speculative: unknown workloads {sorted(unknown)}; known: {', '.join(SETS)}"
        )
    prompts = QUICK_PROMPTS if args.quick else PROMPTS
    result: dict[str, Any] = {"benchmark": "speculative", "quick": bool(args.quick), "workloads": {}}
    for w in workloads:
        result["workloads"][w] = workload(w, prompts[w])
    result["accepted_per_step"] = {
        w: {
            s: {"mean": m["accepted_per_step"], "ci95": m["accepted_per_step_ci95"]}
            for s, m in r["sources"].items()
        }
        for w, r in result["workloads"].items()
    }
    _print(result)
    return result


def workload(name: str, prompts: int | None) -> dict[str, Any]:
    chosen = workload_cases(name, prompts)
    sources = {s: measure(chosen, [s]) for s in SOURCES}
    sources[ALL] = measure(chosen, list(SOURCES))
    lengths = {str(k): measure(chosen, list(SOURCES), fixed=k) for k in FIXED}
    own, every = sources["own"], sources[ALL]
    return {
        "samples": every["samples"],
        "prompts": every["prompts"],
        "tokens": every["tokens"],
        "sources": sources,
        "fixed_lengths": lengths,
        # Against drafting from the request's own tokens alone, as the engines' n-gram proposers do.
        "tokens_per_step_vs_own": every["tokens_per_step"] / own["tokens_per_step"],
        "accepted_per_step_vs_own": (
            every["accepted_per_step"] / own["accepted_per_step"] if own["accepted_per_step"] else None
        ),
    }


def _print(r: dict[str, Any]) -> None:
    console = Console(width=120)
    for w, d in r["workloads"].items():
        t = Table(title=f"{w}: {d['samples']} samples of {d['prompts']} prompts, {d['tokens']:,} tokens")
        for c in (
            "source",
            "draft length",
            "accepted/step",
            "95% interval",
            "tokens/step",
            "acceptance",
            "drafting",
        ):
            t.add_column(c, justify="left" if c == "source" else "right")
        rows = [(s, m) for s, m in d["sources"].items()] + [(ALL, m) for m in d["fixed_lengths"].values()]
        for s, m in rows:
            lo, hi = m["accepted_per_step_ci95"]
            t.add_row(
                s,
                str(m["draft_length"]),
                f"{m['accepted_per_step']:.2f}",
                f"[{lo:.2f}, {hi:.2f}]",
                f"{m['tokens_per_step']:.2f}",
                f"{m['acceptance_rate']:.0%}",
                f"{m['draft_rate']:.0%}",
            )
        console.print(t)
        console.print(f"all sources vs own context: tokens per step x{d['tokens_per_step_vs_own']:.2f}")


BENCHMARK = Benchmark(
    "speculative",
    "drafted tokens accepted per verification step on the recorded traces, by workload, source and length",
    add_arguments,
    run,
)

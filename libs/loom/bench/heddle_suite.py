"""``loom bench heddle-suite``: the Heddle paper's experiments (§7.1-7.4) in virtual time, in one run.

- overall (Figure 12): coding, search and tool use x Qwen3-8B/14B/32B at 64 GPUs, Loom (the heddle preset)
  against verl, verl* and slime at the baselines' model-parallel sizes (1, 1, 2);
- scheduling (Figure 14): FCFS, round-robin, Autellix (PLAS) and progressive priority, the rest Loom's;
- placement (Figure 15): least-load (per-step routing to the least loaded worker past an imbalance
  threshold, else the longest cached prefix: verl*'s router), cache-aware (each trajectory pinned to one
  worker: verl's) and Loom's presorted DP with migration;
- resources (Figure 16): fixed MP 1 and 8 against the annealed allocation;
- prediction (Figure 13's effect on the rollout): no prediction, per-prompt history, the oracle (each
  trajectory known exactly, each tool's latency at its mean: the best any predictor could do) and the
  clairvoyant (the latency draws known too: past any predictor).

Ablations run Qwen3-14B, as the paper's do. The batch is the paper's: 100 trajectories per baseline
worker (6,400 for 8B and 14B, 3,200 for 32B), or as many as the traces hold (search 1,600, tool use 640).
Every Loom cell runs Loom's learned predictor, cross-fitted by prompt (``loom.bench.harness.learned``), with Loom on
exact lengths beside it in the overall cells (an idealisation); the prediction ablation gives the share of
the oracle's gain over no prediction that the learned model keeps. Every cell is one rollout of the
workload from the recorded traces (GRPO groups of 16; coding's samples vary the recorded run).
``--quick`` runs the same grid on 8 GPUs with a handful of prompts per workload. Cells run in parallel
processes; plots and a Markdown report go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loom.bench.acceptance import SOURCES, measure, workload_cases
from loom.bench.harness.bounds import critical_path, undraftable
from loom.bench.harness.cluster import BASELINE_MP, Cluster
from loom.bench.harness.learned import Learned
from loom.bench.harness.rollout import run_rollout
from loom.bench.harness.served import QUICK_ROW_PROMPTS, ROW_PROMPTS, for_file, served
from loom.bench.registry import Benchmark
from loom.bench.rollout import learned_budget, prediction_quality, tail_figures
from loom.bench.speculative import PROMPTS as SPEC_PROMPTS
from loom.bench.speculative import QUICK_PROMPTS as SPEC_QUICK_PROMPTS
from loom.bench.suite_compare import compare, load_previous
from loom.engine.sim.core import Speculation
from loom.protocol import PolicySpec
from loom.workloads import WORKLOADS, Workload, planned_env_s, recorded

WORKLOAD_NAMES = ("coding", "search", "tool_use")
MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
SYSTEMS = ("heddle", "verl", "verl_star", "slime")
ABLATION_MODEL = "qwen3-14b"
GROUP = 16
BATCH_PER_WORKER = 100
QUICK_PROMPTS: dict[str, int | None] = {"coding": 3, "search": 12, "tool_use": 6}
QUICK_FILE_PROMPTS = 12
# Targets of issue 5 for coding on Qwen3-14B at 64 GPUs.
TARGET = {"vs_slime": 2.0, "vs_best_baseline": 1.5, "makespan_over_lb": 1.15}

HEDDLE: dict[str, Any] = {"preset": "heddle"}
ABLATIONS: dict[str, dict[str, dict[str, Any]]] = {
    "scheduling": {
        "fcfs": {**HEDDLE, "order": "fcfs"},
        "rr": {**HEDDLE, "order": "rr"},
        "autellix": {**HEDDLE, "order": "autellix"},
        "pps": HEDDLE,
    },
    "placement": {
        "least_load": {**HEDDLE, "placement": "verl_star"},
        "cache_aware": {**HEDDLE, "placement": "verl"},
        "loom": HEDDLE,
    },
    "resources": {
        "fixed_1": {**HEDDLE, "resources": "fixed", "fixed_mp": 1},
        "fixed_8": {**HEDDLE, "resources": "fixed", "fixed_mp": 8},
        "adaptive": HEDDLE,
    },
}
# Loom's own (learned) last: the ablation plot normalises to the last variant.
PREDICTORS = {
    "none": "none",
    "history": "history",
    "oracle": "oracle",
    "clairvoyant": "clairvoyant",
    "learned": "learned",
}
# The ablation experiments, in the order the results, tables and report give them.
EXPERIMENTS = (*ABLATIONS, "prediction")
# Loom with exact lengths, beside Loom with its learned predictor in every overall cell: an idealisation.
ORACLE = "heddle_oracle"


@dataclass(frozen=True)
class Cell:
    workload: str
    model: str
    gpus: int
    policy: tuple[tuple[str, Any], ...]  # the PolicySpec fields, hashable
    predictor: str = "learned"
    drafting: bool = False  # every engine drafts (speculative decoding), at the workload's measured rates
    # "shared": every engine drafts from every output of the rollout; "local": only from what it served.
    corpus: str = "shared"

    def spec(self) -> dict[str, Any]:
        return dict(self.policy)


@dataclass
class Plan:
    gpus: int
    ablation_gpus: int
    quick: bool
    seed: int
    cells: list[Cell] = field(default_factory=list)

    def cell(
        self,
        workload: str,
        model: str,
        gpus: int,
        policy: dict[str, Any],
        predictor: str = "learned",
        drafting: bool = False,
        corpus: str = "shared",
    ) -> Cell:
        c = Cell(workload, model, gpus, tuple(sorted(policy.items())), predictor, drafting, corpus)
        if c not in self.cells:
            self.cells.append(c)
        return c


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=None, help="GPUs per cell (default 64, quick 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=None, help="parallel processes (default: the CPU count)")
    p.add_argument("--out", default="bench-out/heddle-suite", help="where plots and report.md go")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument(
        "--speculative",
        action="store_true",
        help="also every overall cell with drafting engines, Loom and the baselines alike",
    )
    p.add_argument(
        "--predictor-steps",
        type=int,
        default=None,
        help="optimiser steps per fold of the learned predictor",
    )
    p.add_argument(
        "--workload",
        default=None,
        help="a rollout-trace file to run every cell on instead of the built-in workloads (one training step, "
        "as recorded; the learned predictor reads its text, or where it has none, serves what lengths allow)",
    )
    p.add_argument("--step", type=int, default=None, help="the file's training step (default its first)")
    p.add_argument(
        "--against",
        default=None,
        help="an earlier run's results.json (same GPUs): every cell now over then, and the cells that lost "
        "more than 1%%",
    )


def prompts_for(workload: str, model: str, gpus: int, quick: bool) -> int | None:
    """Heddle §7.1: 100 trajectories per baseline worker (64 workers for 8B and 14B, 32 for 32B at MP 2),
    as far as the traces hold prompts (search and tool use hold fewer)."""
    if workload not in WORKLOADS:  # a rollout-trace file: its step as recorded (quick: its first prompts)
        return QUICK_FILE_PROMPTS if quick else None
    if quick:
        return QUICK_PROMPTS[workload]
    workers = gpus // BASELINE_MP.get(model, 1)
    return max(1, BATCH_PER_WORKER * workers // GROUP)


def _run_cell(
    args: tuple[Cell, int | None, int, bool, Learned | None, Speculation | None, int | None],
) -> dict[str, Any]:
    cell, prompts, seed, timelines, learned, speculation, step = args
    gpus = cell.gpus
    workload, tool_s = workload_of(cell.workload, prompts, seed, step)
    cluster = Cluster(gpus=gpus, model=cell.model, tool_s=tool_s)
    policy = PolicySpec(**cell.spec()).resolved()
    r = run_rollout(
        workload,
        policy,
        cluster,
        cell.predictor,
        seed,
        gantt_workers=4 if timelines else 0,
        learned=learned,
        speculation=speculation,
    )
    out = r.summary()
    out["trajectories"] = len(workload.trajectories)
    if speculation is not None:
        out["undraftable_s"] = round(undraftable(workload, cluster), 2)
        out["drafting_critical_path_s"] = round(critical_path(workload, cluster, speculation), 2)
    if timelines:
        out["timeline"] = {
            "active": r.active_over_time(100),
            "throughput": r.throughput_over_time(100),
            "finish_s": sorted(round(f, 1) for f in r.finish_s),
            "gantt": [(w, round(a, 2), round(b, 2), i) for w, a, b, i in r.gantt],
        }
    return out


def workload_of(name: str, prompts: int | None, seed: int, step: int | None = None) -> tuple[Workload, float]:
    """A cell's batch and the environment seconds per call its cluster assumes: a built-in workload by name
    (GRPO groups of 16), else a rollout-trace file's step ``step`` as recorded."""
    if name in WORKLOADS:
        return WORKLOADS[name](prompts=prompts, group_size=GROUP, seed=seed), planned_env_s(name, GROUP, seed)
    rec = recorded.load(name)
    return rec.batch(step, prompts), rec.mean_env_s()


def build_plan(
    quick: bool,
    gpus: int | None,
    seed: int,
    speculative: bool = False,
    workloads: tuple[str, ...] = WORKLOAD_NAMES,
) -> tuple[Plan, dict[str, Any]]:
    g = gpus or (8 if quick else 64)
    # Ablations on a quarter of the GPUs with a quarter of the batch (the same 100 trajectories per
    # worker): the full suite then fits in ten minutes on two cores (at half of each it took eleven).
    plan = Plan(g, g if quick else max(1, g // 4), quick, seed)
    ag = plan.ablation_gpus
    layout: dict[str, Any] = {
        "overall": {},
        "scheduling": {},
        "placement": {},
        "resources": {},
        "prediction": {},
    }
    for w in workloads:
        layout["overall"][w] = {
            m: {
                **{s: plan.cell(w, m, g, {"preset": s}) for s in SYSTEMS},
                ORACLE: plan.cell(w, m, g, HEDDLE, "oracle"),
            }
            for m in MODELS
        }
        for exp, variants in ABLATIONS.items():
            layout[exp][w] = {v: plan.cell(w, ABLATION_MODEL, ag, spec) for v, spec in variants.items()}
        layout["prediction"][w] = {
            v: plan.cell(w, ABLATION_MODEL, ag, HEDDLE, pred) for v, pred in PREDICTORS.items()
        }
        if speculative:
            layout.setdefault("drafting", {})[w] = {
                m: {s: plan.cell(w, m, g, {"preset": s}, drafting=True) for s in SYSTEMS} for m in MODELS
            }
            layout.setdefault("drafting_local", {})[w] = {
                m: {s: plan.cell(w, m, g, {"preset": s}, drafting=True, corpus="local") for s in SYSTEMS}
                for m in MODELS
            }
    return plan, layout


# What an engine drafts from when it served neither the group nor the task before: the trajectory's own
# context and other tasks' outputs.
FAR_SOURCES = ("own", "corpus")


@dataclass(frozen=True)
class Rates:
    near: Speculation  # every source: the group's and the task's outputs are on the engine
    far: Speculation  # FAR_SOURCES only

    def local(self, share: float) -> Speculation:
        """The expected rates when ``share`` of the tokens are generated where the group's outputs are."""
        return Speculation(
            positions=share * self.near.positions + (1 - share) * self.far.positions,
            tokens_per_step=share * self.near.tokens_per_step + (1 - share) * self.far.tokens_per_step,
        )


def _rates(m: dict[str, Any]) -> Speculation:
    drafted = m["accepted_per_step"] / m["acceptance_rate"] if m["acceptance_rate"] else 0.0
    return Speculation(positions=1.0 + drafted, tokens_per_step=m["tokens_per_step"])


def speculation_for(workload: str, quick: bool) -> tuple[Rates, dict[str, Any]]:
    """The engine model's drafting rates for a workload: drafts from every source with the adaptive length,
    replayed on the workload's recorded traces (``loom bench speculative``'s "all"), and from FAR_SOURCES."""
    prompts = (SPEC_QUICK_PROMPTS if quick else SPEC_PROMPTS)[workload]
    cases = workload_cases(workload, prompts)
    near, far = measure(cases, list(SOURCES)), measure(cases, list(FAR_SOURCES))
    rates = Rates(_rates(near), _rates(far))
    return rates, {
        "positions": rates.near.positions,
        "tokens_per_step": rates.near.tokens_per_step,
        "accepted_per_step": near["accepted_per_step"],
        "accepted_per_step_ci95": near["accepted_per_step_ci95"],
        "samples": near["samples"],
        "far": {
            "sources": list(FAR_SOURCES),
            "positions": rates.far.positions,
            "tokens_per_step": rates.far.tokens_per_step,
            "accepted_per_step": far["accepted_per_step"],
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    wall0 = time.perf_counter()
    names: tuple[str, ...] = WORKLOAD_NAMES
    files: dict[str, recorded.Recorded] = {}  # a --workload file, read once here (each cell process reads it)
    if args.workload:
        if args.speculative:
            raise SystemExit(
                "heddle-suite: --speculative drafts from the built-in traces' text, not a --workload file"
            )
        try:
            files[args.workload] = recorded.load(args.workload)
            files[args.workload].step(args.step)
        except (ValueError, OSError) as e:  # a malformed line names its line and field
            raise SystemExit(f"--workload: {e}") from None
        names = (args.workload,)
    plan, layout = build_plan(args.quick, args.gpus, args.seed, args.speculative, names)
    try:  # read before the run: a wrong file should not cost the run first
        previous = load_previous(args.against, plan.gpus, plan.ablation_gpus) if args.against else None
    except ValueError as e:
        raise SystemExit(str(e)) from None
    drafting = {w: speculation_for(w, plan.quick) for w in names} if args.speculative else {}
    # Timelines (active trajectories, Gantt) are kept for the cells the plots draw.
    drawn = {c for w in names for s, c in layout["overall"][w][ABLATION_MODEL].items() if s != ORACLE}
    drawn |= set(layout["resources"][shown(names, "search")].values())
    jobs = args.jobs or max(1, min(len(plan.cells), os.cpu_count() or 1))
    prompts = {c: prompts_for(c.workload, c.model, c.gpus, plan.quick) for c in plan.cells}
    # Every cell's batch is a prefix of its workload's largest in the plan: one cross-fitting covers them all.
    largest = {
        w: files[w].batch(args.step, _most(plan, prompts, w))
        if w in files
        else workload_of(w, _most(plan, prompts, w), plan.seed)[0]
        for w in names
    }
    budget = learned_budget(plan.quick, args.predictor_steps, plan.seed)
    rows = QUICK_ROW_PROMPTS if plan.quick else ROW_PROMPTS
    learned = {
        w: for_file(files[w], workload, budget, rows)[0] if w in files else served(workload, budget, rows)
        for w, workload in largest.items()
    }
    work = [
        (
            c,
            prompts[c],
            plan.seed,
            c in drawn,
            learned[c.workload] if c.predictor == "learned" else None,
            drafting[c.workload][0].near if c.drafting else None,
            args.step,
        )
        for c in plan.cells
        if c.corpus == "shared"
    ]
    # The longest cells first, so that the pool's last minutes are not one straggler.
    order = sorted(range(len(work)), key=lambda i: (work[i][0].workload != names[0], -work[i][0].gpus, i))
    results: dict[Cell, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for i, res in zip(order, pool.map(_run_cell, [work[i] for i in order]), strict=True):
            results[work[i][0]] = res
        if drafting:
            # Engines that draft only from what they served: at the share of tokens that Loom's placement put
            # where a sibling had run (measured in the plain cell), the group's rates; elsewhere the far ones.
            local = [
                (
                    c,
                    prompts[c],
                    plan.seed,
                    False,
                    learned[w] if c.predictor == "learned" else None,
                    drafting[w][0].local(results[layout["overall"][w][m][sys]]["sibling_local_share"]),
                    None,  # drafting runs the built-in workloads only
                )
                for w, by_m in layout["drafting_local"].items()
                for m, by_s in by_m.items()
                for sys, c in by_s.items()
            ]
            for (c, *_), res in zip(local, pool.map(_run_cell, local), strict=True):
                results[c] = res
    out = _assemble(plan, layout, results)
    if drafting:
        out["speculation"] = {w: figures for w, (_, figures) in drafting.items()}
    # How well the learned model ranks each workload's batch (its largest in the plan), with intervals.
    out["prediction_quality"] = {
        w: prediction_quality(largest[w], learned[w]) for w in names if learned[w].totals
    }
    if previous is not None:
        out["against"] = {"file": args.against, **compare(previous, out, EXPERIMENTS)}
    out["wall_s"] = round(time.perf_counter() - wall0, 1)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(out, indent=1))
    if not args.no_plots:
        from loom.bench.suite_report import write_report

        out["report"] = str(write_report(out_dir, out, {c: results[c] for c in drawn}, layout))
    _print(out)
    return out


def shown(names: Sequence[str], preferred: str) -> str:
    """The workload a plot or headline shows: ``preferred`` where the suite ran it, else its first."""
    return preferred if preferred in names else names[0]


def _most(plan: Plan, prompts: dict[Cell, int | None], workload: str) -> int | None:
    sizes = [prompts[c] for c in plan.cells if c.workload == workload]
    return None if None in sizes else max(s for s in sizes if s is not None)


def _assemble(plan: Plan, layout: dict[str, Any], results: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    def slim(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k != "timeline"}

    overall: dict[str, Any] = {}
    for w, by_model in layout["overall"].items():
        overall[w] = {}
        for m, cells in by_model.items():
            runs = {s: slim(results[c]) for s, c in cells.items()}
            oracle = runs.pop(ORACLE)
            loom = runs["heddle"]["throughput_tok_s"]
            ratios = {s: round(loom / r["throughput_tok_s"], 3) for s, r in runs.items() if s != "heddle"}
            overall[w][m] = {
                "systems": runs,
                "speedup": ratios,
                "vs_best_baseline": min(ratios.values()),
                # What no schedule can beat: the best baseline's makespan over the lower bound (the same work
                # in less than LB is impossible), the most any system can be ahead of it.
                "ceiling_vs_best": round(
                    loom
                    * runs["heddle"]["makespan_over_lb"]
                    / max(r["throughput_tok_s"] for s, r in runs.items() if s != "heddle"),
                    3,
                ),
                "makespan_over_lb": runs["heddle"]["makespan_over_lb"],
                **tail_figures(runs),
                "oracle": {
                    "throughput_tok_s": oracle["throughput_tok_s"],
                    "makespan_over_lb": oracle["makespan_over_lb"],
                    "speedup": {
                        s: round(oracle["throughput_tok_s"] / r["throughput_tok_s"], 3)
                        for s, r in runs.items()
                        if s != "heddle"
                    },
                },
            }
            cell = overall[w][m]
            cell["ceiling_share"] = round(cell["vs_best_baseline"] / cell["ceiling_vs_best"], 3)
    ablations: dict[str, Any] = {}
    for exp in EXPERIMENTS:
        ablations[exp] = {}
        for w, cells in layout[exp].items():
            runs = {v: slim(results[c]) for v, c in cells.items()}
            ablations[exp][w] = {
                v: {
                    "throughput_tok_s": r["throughput_tok_s"],
                    "makespan_s": r["makespan_s"],
                    "longest_traj_queueing_s": r["longest_traj_queueing_s"],
                    "makespan_over_lb": r["makespan_over_lb"],
                }
                for v, r in runs.items()
            }
    # The share of the oracle's gain over no prediction that the learned predictor keeps, per workload; and
    # of the clairvoyant's, whose extra gain is foreknowledge of tool latencies no predictor has.
    kept = {w: _kept(runs, "oracle") for w, runs in ablations["prediction"].items()}
    kept_clairvoyant = {w: _kept(runs, "clairvoyant") for w, runs in ablations["prediction"].items()}
    main = shown(list(overall), "coding")
    cell = overall[main][ABLATION_MODEL]
    target = {
        "cell": f"{main}, {ABLATION_MODEL}, {plan.gpus} GPUs",
        "vs_slime": cell["speedup"]["slime"],
        "vs_best_baseline": cell["vs_best_baseline"],
        "makespan_over_lb": cell["makespan_over_lb"],
        "want": TARGET,
        "met": {
            "vs_slime": cell["speedup"]["slime"] >= TARGET["vs_slime"],
            "vs_best_baseline": cell["vs_best_baseline"] >= TARGET["vs_best_baseline"],
            "makespan_over_lb": cell["makespan_over_lb"] <= TARGET["makespan_over_lb"],
        },
        "makespan_breakdown": cell["systems"]["heddle"]["makespan_breakdown"],
        "last_finisher": cell["systems"]["heddle"]["last_finisher"],
    }
    shares = [v for v in kept.values() if v is not None]
    speculative = _speculative(layout, results, overall) if "drafting" in layout else {}
    return {
        "benchmark": "heddle-suite",
        "gpus": plan.gpus,
        "ablation_gpus": plan.ablation_gpus,
        "cells": len(results),
        "predictor": "learned",
        "target": target,
        # Issue 38's bar: every cell at least 1.2x its best baseline, the learned predictor keeping at least
        # 0.8 of the oracle's gain on every workload.
        "min_ratio_vs_best": min(c["vs_best_baseline"] for by_m in overall.values() for c in by_m.values()),
        # Issue 50's bar: Loom over the best baseline, as a share of the most any schedule can be ahead of it.
        "min_ceiling_share": min(c["ceiling_share"] for by_m in overall.values() for c in by_m.values()),
        "min_learned_share": min(shares) if len(shares) == len(kept) else None,
        "learned_keeps_of_oracle_gain": kept,
        "learned_keeps_of_clairvoyant_gain": kept_clairvoyant,
        "overall": overall,
        **ablations,
        **speculative,
    }


def _kept(runs: dict[str, dict[str, Any]], ideal: str) -> float | None:
    """The share of ``ideal``'s throughput gain over no prediction that the learned predictor keeps."""
    none = runs["none"]["throughput_tok_s"]
    gain = runs[ideal]["throughput_tok_s"] - none
    return round((runs["learned"]["throughput_tok_s"] - none) / gain, 3) if gain > 0 else None


def _speculative(
    layout: dict[str, Any], results: dict[Cell, dict[str, Any]], overall: dict[str, Any]
) -> dict[str, Any]:
    """Every overall cell again with drafting engines: Loom with drafting over Loom without (what drafting
    buys, ``speculative_gain``) and over the best baseline given the same drafting (what scheduling still
    buys under it)."""
    cells: dict[str, Any] = {}
    for w, by_model in layout["drafting"].items():
        cells[w] = {}
        for m, by_system in by_model.items():
            tok = {s: results[c]["throughput_tok_s"] for s, c in by_system.items()}
            best = max(v for s, v in tok.items() if s != "heddle")
            plain = overall[w][m]["systems"]
            cells[w][m] = {
                "throughput_tok_s": tok,
                "output_tokens": {s: results[c]["output_tokens"] for s, c in by_system.items()},
                "gain": {s: round(tok[s] / plain[s]["throughput_tok_s"], 3) for s in tok},
                "vs_best_baseline": round(tok["heddle"] / best, 3),
                # The most drafting at these rates could buy Loom under any schedule: its plain makespan over the
                # longest trajectory alone on a drafting engine (loom.bench.harness.bounds.critical_path); and at any
                # rates, over its prefills and tool time, which drafting cannot shorten (bounds.undraftable).
                "gain_ceiling": round(
                    plain["heddle"]["makespan_s"] / results[by_system["heddle"]]["drafting_critical_path_s"],
                    3,
                ),
                "gain_ceiling_any_drafting": round(
                    plain["heddle"]["makespan_s"] / results[by_system["heddle"]]["undraftable_s"], 3
                ),
                # No makespan/LB here: the lower bound (loom.bench.harness.bounds) prices plain decoding, and a
                # drafting engine's decode beats it.
            }
    gains = {w: {m: c["gain"]["heddle"] for m, c in by_m.items()} for w, by_m in cells.items()}
    # Engines drafting only from what each served (as SGLang's and vLLM's do), against every engine drafting
    # from every output: each system at its own placement's share of tokens generated beside a sibling.
    local: dict[str, Any] = {}
    for w, by_m in layout["drafting_local"].items():
        local[w] = {}
        for m, by_system in by_m.items():
            plain = overall[w][m]["systems"]
            tok = {s: results[c]["throughput_tok_s"] for s, c in by_system.items()}
            local[w][m] = {
                "sibling_local_share": {s: plain[s]["sibling_local_share"] for s in tok},
                "throughput_tok_s": tok,
                "gain": {s: round(tok[s] / plain[s]["throughput_tok_s"], 3) for s in tok},
                "vs_shared": {s: round(tok[s] / cells[w][m]["throughput_tok_s"][s], 3) for s in tok},
                "vs_best_baseline": round(tok["heddle"] / max(v for s, v in tok.items() if s != "heddle"), 3),
            }
    return {
        "drafting": cells,
        "local_corpus": local,
        "speculative_gain": gains,
        "speculative_gain_ceiling": {
            w: {m: c["gain_ceiling"] for m, c in by_m.items()} for w, by_m in cells.items()
        },
        "speculative_gain_local": {
            w: {m: c["gain"]["heddle"] for m, c in by_m.items()} for w, by_m in local.items()
        },
        "drafting_local_min_ratio_vs_best": min(
            c["vs_best_baseline"] for by_m in local.values() for c in by_m.values()
        ),
        "min_speculative_gain": min(g for by_m in gains.values() for g in by_m.values()),
        "drafting_min_ratio_vs_best": min(
            c["vs_best_baseline"] for by_m in cells.values() for c in by_m.values()
        ),
    }


def _print(out: dict[str, Any]) -> None:
    t = Table(title=f"Heddle suite, {out['gpus']} GPUs: Loom's throughput over each baseline")
    cols = ("workload", "model", "Loom tok/s", "x verl", "x verl*", "x slime", "Loom makespan/LB")
    for c in (*cols, "tail share Loom / slime", "tail cut vs slime"):
        t.add_column(c, justify="right")
    for w, by_model in out["overall"].items():
        for m, r in by_model.items():
            sp, tail = r["speedup"], r["tail_share"]
            cut = r.get("tail_cut_vs_slime")
            t.add_row(
                w,
                m,
                f"{r['systems']['heddle']['throughput_tok_s']:,.0f}",
                f"{sp['verl']:.2f}",
                f"{sp['verl_star']:.2f}",
                f"{sp['slime']:.2f}",
                f"{r['makespan_over_lb']:.2f}",
                f"{tail['heddle']:.0%} / {tail['slime']:.0%}",
                "-" if cut is None else f"{cut:.0%}",
            )
    Console().print(t)
    for exp in EXPERIMENTS:
        t = Table(title=f"{exp} ({ABLATION_MODEL}, {out['ablation_gpus']} GPUs): throughput tok/s")
        t.add_column("workload")
        variants = list(next(iter(out[exp].values())))
        for v in variants:
            t.add_column(v, justify="right")
        for w, runs in out[exp].items():
            t.add_row(w, *(f"{runs[v]['throughput_tok_s']:,.0f}" for v in variants))
        Console().print(t)
    tg = out["target"]
    Console().print(
        f"Target ({tg['cell']}): x slime {tg['vs_slime']} (want >= {TARGET['vs_slime']}), x best baseline "
        f"{tg['vs_best_baseline']} (want >= {TARGET['vs_best_baseline']}), makespan/LB "
        f"{tg['makespan_over_lb']} (want <= {TARGET['makespan_over_lb']}); Loom's last trajectory: "
        f"{tg['makespan_breakdown']}, {tg['last_finisher']}; wall {out['wall_s']} s"
    )
    if "drafting" in out:
        t = Table(title="Drafting engines (speculative decoding at each workload's measured rates)")
        for c in (
            "workload",
            "model",
            "Loom with / without",
            "Loom x best baseline, both drafting",
            "ceiling of with / without",
            "spec rates",
        ):
            t.add_column(c, justify="right")
        for w, by_model in out["drafting"].items():
            rates = out["speculation"][w]
            for m, r in by_model.items():
                t.add_row(
                    w,
                    m,
                    f"{r['gain']['heddle']:.2f}",
                    f"{r['vs_best_baseline']:.2f}",
                    f"{r['gain_ceiling']:.2f}",
                    f"{rates['positions']:.2f} positions, {rates['tokens_per_step']:.2f} tokens/step",
                )
        Console().print(t)
        t = Table(title="Engines drafting only from what each served (SGLang's and vLLM's n-gram caches)")
        local_cols = ("workload", "model", "tokens beside a sibling, Loom / best", "Loom with / without")
        for c in (*local_cols, "Loom x shared corpus", "Loom x best baseline"):
            t.add_column(c, justify="right")
        for w, by_model in out["local_corpus"].items():
            for m, r in by_model.items():
                share = r["sibling_local_share"]
                best = max((s for s in share if s != "heddle"), key=lambda s: r["throughput_tok_s"][s])
                t.add_row(
                    w,
                    m,
                    f"{share['heddle']:.0%} / {share[best]:.0%}",
                    f"{r['gain']['heddle']:.2f}",
                    f"{r['vs_shared']['heddle']:.3f}",
                    f"{r['vs_best_baseline']:.2f}",
                )
        Console().print(t)
    Console().print(
        f"Every cell over its best baseline: at least {out['min_ratio_vs_best']}x (want >= 1.2); the learned "
        f"predictor keeps at least {out['min_learned_share']} of the oracle's gain (want >= 0.8)"
    )
    if "against" in out:
        a = out["against"]
        lost = ", ".join(f"{x['cell']} {x['ratio']:.3f}" for x in a["losing"]) or "none"
        worst = "-" if a["worst"] is None else f"{a['worst']['cell']} {a['worst']['ratio']:.3f}"
        Console().print(
            f"Against {a['file']}: {a['compared']} cells compared, worst {worst}; lost more than "
            f"{a['tolerance']:.0%}: {lost}"
        )


BENCHMARK = Benchmark(
    "heddle-suite", "the Heddle paper's overall comparison and ablations, in virtual time", add_arguments, run
)

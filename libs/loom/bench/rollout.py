"""``loom bench rollout``: one workload on a simulated cluster in virtual time, the policy under test
against the baselines in the same run.

Workloads come from the recorded traces (``--traces`` takes any file of the same schema): coding
(SWE-bench), search (HotpotQA ReAct), tool use (tau-bench). The JSON has the policy's figures at the top
level and every policy's under ``policies``, with throughput ratios of the policy over each baseline.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from loom.bench.harness.cluster import Cluster, fixed_degree
from loom.bench.harness.learned import FOLDS, STEPS_PER_FOLD, Budget, Learned
from loom.bench.harness.rollout import PREDICTORS, run_rollout
from loom.bench.harness.served import GROUP, QUICK_ROW_PROMPTS, ROW_PROMPTS, for_file, served
from loom.bench.registry import Benchmark
from loom.predict import evaluate
from loom.protocol import PRESETS, PolicySpec
from loom.workloads import WORKLOADS, Workload, planned_env_s, recorded
from loom.workloads.coding import SIBLINGS

BASELINES = ("verl", "verl_star", "slime")
# A small version of the cross-fitting for --quick: two folds of fifty steps each (about fifteen seconds).
QUICK_BUDGET = Budget(steps_per_fold=50, folds=2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--policy", default="heddle", help="a preset name or a policy as JSON")
    p.add_argument("--baselines", default=",".join(BASELINES), help="comma-separated presets ('' for none)")


def _policy(text: str) -> PolicySpec:
    """A preset name or a policy as JSON, validated like a job spec's."""
    try:
        raw = {"preset": text} if text in PRESETS else json.loads(text)
        return msgspec.convert(raw, PolicySpec)
    except (ValueError, msgspec.ValidationError) as e:
        raise SystemExit(
            f"loom bench rollout: bad policy {text!r}: {e} (presets: {', '.join(PRESETS)})"
        ) from e


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Policies are checked before the workload loads and the predictor trains: a typo fails in a second.
    name = args.policy
    runs = {name: _policy(name)}
    for b in filter(None, args.baselines.split(",")):
        runs.setdefault(b, _policy(b))
    gpus = min(args.gpus, 8) if args.quick else args.gpus
    try:
        for pol in runs.values():
            fixed_degree(pol.resolved(), Cluster(gpus=gpus, model=args.model))
    except ValueError as e:
        raise SystemExit(f"loom bench rollout: {e}") from None
    replay = replay_of(args)
    workload, learned, predictor, source = replay.workload, replay.learned, replay.predictor, replay.source
    cluster = Cluster(gpus=gpus, gpu=args.gpu, model=args.model, tool_s=replay.tool_s)
    results: dict[str, dict[str, Any]] = {}
    for label, pol in runs.items():
        if len(replay.steps) > 1:
            results[label] = _steps_in_order(replay.steps, pol, cluster, args.predictor, args.seed, learned)
            continue
        r = run_rollout(workload, pol.resolved(), cluster, args.predictor, args.seed, learned=learned)
        ts, rate = r.throughput_over_time(20)
        # Utilisation over time: the cluster's generation rate in 20 windows, over its peak window.
        peak = max(rate, default=0.0) or 1.0
        results[label] = {
            **r.summary(),
            "utilisation": {"t_s": [round(t, 1) for t in ts], "of_peak": [round(x / peak, 3) for x in rate]},
        }
    top = results[name]
    out: dict[str, Any] = {
        "benchmark": "rollout",
        "workload": args.workload,
        **source,
        "model": args.model,
        "gpus": gpus,
        "trajectories": sum(len(w.trajectories) for w in replay.steps) or len(workload.trajectories),
        "policy": name,
        "predictor": predictor,
        "siblings": args.siblings if args.workload == "coding" else "recorded trials",
        **(
            {"prediction": prediction_quality(workload, learned)}
            if learned is not None and learned.totals
            else {}
        ),
        **top,
        "throughput_ratio": {
            b: round(top["throughput_tok_s"] / r["throughput_tok_s"], 3)
            for b, r in results.items()
            if b != name
        },
        **{k: v for k, v in tail_figures(results, name).items() if k != "tail_share"},
        "policies": results,
    }
    _print(out)
    return out


def _steps_in_order(
    steps: Sequence[Workload],
    policy: PolicySpec,
    cluster: Cluster,
    predictor: str,
    seed: int,
    learned: Learned | None,
) -> dict[str, Any]:
    """A rollout log's training steps one after another (each step's rollout starts when the last one ends,
    as a synchronous trainer runs them), each prompt's totals at earlier steps its history; the figures
    summed over the steps (throughput: all the tokens over all the time), and each step's."""
    earlier: dict[str, list[float]] = {}
    per_step = []
    for w in steps:
        r = run_rollout(w, policy.resolved(), cluster, predictor, seed, learned=learned, earlier=earlier)
        per_step.append(r.summary())
        for t in w.trajectories:
            earlier.setdefault(t.prompt, []).append(float(t.output_tokens))
    makespan = sum(s["makespan_s"] for s in per_step)
    tokens = sum(s["output_tokens"] for s in per_step)
    bound = sum(s["lower_bound_s"] for s in per_step)
    tail = sum(s["tail_s"] for s in per_step)
    return {
        "makespan_s": round(makespan, 1),
        "throughput_tok_s": round(tokens / makespan, 1) if makespan else 0.0,
        "lower_bound_s": round(bound, 1),
        "makespan_over_lb": round(makespan / bound, 3) if bound else 0.0,
        "longest_traj_queueing_s": max(s["longest_traj_queueing_s"] for s in per_step),
        "tail_s": round(tail, 2),
        "tail_share": round(tail / makespan, 4) if makespan else 0.0,
        "output_tokens": tokens,
        "migrations": sum(s["migrations"] for s in per_step),
        "wall_s": round(sum(s["wall_s"] for s in per_step), 2),
        "steps": per_step,
    }


@dataclass(frozen=True)
class Replay:
    """A workload as the harness replays it, with the predictor it runs under."""

    workload: Workload  # the batch (a file's first step replayed, with ``--step all``)
    tool_s: float  # the cluster's environment seconds per call
    learned: Learned | None
    predictor: str  # what the report calls the predictor
    source: dict[str, Any]  # what the report says of a rollout-trace file ({} for a built-in workload)
    # With ``--step all``: every step of the file, in order (the first is ``workload``).
    steps: tuple[Workload, ...] = ()


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What names a workload and its predictor: ``loom bench rollout``'s and ``loom plan``'s."""
    p.add_argument(
        "--workload",
        default="coding",
        help=f"a built-in workload ({', '.join(sorted(WORKLOADS))}) or a rollout-trace file (README: "
        "'Your own workload'), replayed as recorded: its groups, lengths and environment times",
    )
    p.add_argument(
        "--step",
        default=None,
        help="a rollout-trace file's training step (default its first); 'all' (bench rollout): every step in "
        "order, each prompt's earlier steps its history",
    )
    p.add_argument(
        "--predictor",
        choices=PREDICTORS,
        default="learned",
        help="Loom's learned model, cross-fitted by prompt (default); oracle (exact trajectories, tool "
        "latencies at their mean), clairvoyant (the latencies too), history, none: ablations",
    )
    p.add_argument(
        "--predictor-steps",
        type=int,
        default=None,
        help=f"optimiser steps per fold of the learned predictor (default {STEPS_PER_FOLD}; quick "
        f"{QUICK_BUDGET.steps_per_fold} with {QUICK_BUDGET.folds} folds); cached under $LOOM_HOME",
    )
    p.add_argument(
        "--siblings",
        choices=SIBLINGS,
        default="varied",
        help="coding: samples of a group vary the recorded run (default) or replay it exactly",
    )
    p.add_argument(
        "--prompts", type=int, default=None, help="prompts to take from the workload (default all)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces", default=None, help="a built-in workload's trace file of its own schema")


def replay_of(args: argparse.Namespace) -> Replay:
    """The workload ``add_workload_arguments`` named, and its predictor (the learned one trained or read from
    the cache; on a file, reading its text, or what its lengths allow where it has none: ``for_file``)."""
    quick = getattr(args, "quick", False)
    prompts = args.prompts if args.prompts is not None else (12 if quick else None)
    source: dict[str, Any] = {}
    if args.workload in WORKLOADS:
        workload = load_workload(
            args.workload, prompts, GROUP[args.workload], args.seed, args.traces, args.siblings
        )
        tool_s = planned_env_s(args.workload, GROUP[args.workload], args.seed, args.traces)
    else:
        rec, steps, tool_s, source = _recorded(args.workload, args.step, prompts)
        workload = steps[0]
    learned, predictor = None, args.predictor
    if args.predictor == "learned":
        budget = learned_budget(quick, args.predictor_steps, args.seed)
        rows = QUICK_ROW_PROMPTS if quick else ROW_PROMPTS
        if source:
            every = Workload(workload.name, workload.source, [t for w in steps for t in w.trajectories])
            learned, predictor = for_file(rec, every, budget, rows)
        else:
            learned = served(workload, budget, rows)
    return Replay(workload, tool_s, learned, predictor, source, tuple(steps) if source else ())


def _recorded(
    path: str, step: str | None, prompts: int | None
) -> tuple[recorded.Recorded, list[Workload], float, dict[str, Any]]:
    """A rollout-trace file, its batch at ``step`` (every step's, in order, for "all"; each its first
    prompts only, where ``prompts`` says), the mean environment time per call it recorded, and what the
    report says of it."""
    if not Path(path).exists():
        raise SystemExit(
            f"--workload {path!r} is neither a built-in workload ({', '.join(sorted(WORKLOADS))}) nor a file"
        )
    try:
        rec = recorded.load(path)
        if step == "all":
            chosen: list[int] = sorted(rec.steps)
        else:
            chosen = [rec.step(_step_number(step))[0]]
    except ValueError as e:  # TraceFormatError names the line and field
        raise SystemExit(f"--workload: {e}") from None
    out = [rec.batch(s, prompts) for s in chosen]
    report = {
        "file": {
            "path": str(path),
            "step": chosen if step == "all" else chosen[0],
            "steps": sorted(rec.steps),
            "groups": out[0].groups,
            "text": rec.has_text,
            "turns_without_env_s": rec.turns_without_env_s,
        }
    }
    return rec, out, rec.mean_env_s(), report


def _step_number(step: str | None) -> int | None:
    if step is None:
        return None
    try:
        return int(step)
    except ValueError:
        raise ValueError(f"--step {step!r}: a step number, or 'all'") from None


def load_workload(
    name: str, prompts: int | None, group: int, seed: int, traces: str | None = None, siblings: str = "varied"
) -> Workload:
    extra = {"siblings": siblings} if name == "coding" else {}
    return WORKLOADS[name](prompts=prompts, group_size=group, seed=seed, path=traces, **extra)


def learned_budget(quick: bool, steps: int | None, seed: int) -> Budget:
    base = QUICK_BUDGET if quick else Budget(STEPS_PER_FOLD, FOLDS)
    return Budget(steps if steps is not None else base.steps_per_fold, base.folds, seed)


def prediction_quality(workload: Workload, learned: Learned) -> dict[str, Any]:
    """The learned predictor's recall of the top 10% and Pearson's r against the true totals, at admission
    (step 0) and after two calls (step 2, over the trajectories that make two calls), with 95% intervals."""
    out: dict[str, Any] = {
        "admission_log_sd": round(learned.admission_log_sd, 3),
        "admission_slope": round(learned.admission_slope, 3),
    }
    for k in (0, 2):
        trajs = [t for t in workload.trajectories if len(t.steps) > k]
        if len(trajs) < 10:
            continue
        actual = [float(t.output_tokens) for t in trajs]
        predicted = [float(learned.totals[t.id][k]) for t in trajs]
        out[f"step{k}"] = {
            name: {
                "estimate": round(iv.estimate, 3),
                "ci95": [round(iv.low, 3), round(iv.high, 3)],
            }
            for name, metric in (("recall", evaluate.tail_recall), ("pearson", evaluate.pearson))
            for iv in [evaluate.bootstrap(metric, actual, predicted, samples=500)]
        }
    return out


def tail_figures(runs: dict[str, dict[str, Any]], loom: str = "heddle") -> dict[str, Any]:
    """Each system's tail share (the makespan's share spent finishing the last 10% of trajectories), Loom's
    against each baseline's, and the share of slime's tail seconds Loom cuts (Seer's measure)."""
    mine = runs[loom]
    return {
        "tail_share": {s: r["tail_share"] for s, r in runs.items()},
        "tail_share_ratio": {
            s: round(mine["tail_share"] / r["tail_share"], 3) if r["tail_share"] > 0 else None
            for s, r in runs.items()
            if s != loom
        },
        **(
            {"tail_cut_vs_slime": round(1 - mine["tail_s"] / runs["slime"]["tail_s"], 3)}
            if runs.get("slime", {}).get("tail_s")
            else {}
        ),
    }


def _print(out: dict[str, Any]) -> None:
    t = Table(
        title=f"Rollout: {out['workload']}, {out['model']}, {out['gpus']} GPUs, {out['trajectories']} trajectories"
    )
    for c in (
        "policy",
        "throughput tok/s",
        "makespan s",
        "makespan / LB",
        "longest queueing s",
        "migrations",
        "tail share",
        "wall s",
    ):
        t.add_column(c, justify="right")
    for label, r in out["policies"].items():
        t.add_row(
            label,
            f"{r['throughput_tok_s']:,.0f}",
            f"{r['makespan_s']:,.0f}",
            f"{r['makespan_over_lb']:.2f}",
            f"{r['longest_traj_queueing_s']:,.0f}",
            str(r["migrations"]),
            f"{r['tail_share']:.0%}",
            f"{r['wall_s']:.1f}",
        )
    Console().print(t)


BENCHMARK = Benchmark(
    "rollout", "a workload in virtual time: a policy against the baselines", add_arguments, run
)

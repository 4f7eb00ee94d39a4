"""``loom bench predictor``: progressive length prediction against prompt-only and history-based prediction
(Heddle §4.1, §7.3 and Figure 13), on the held-out split of a trace file, and the served model's latency.

The split is by task, so no test prompt was seen in training. At step k (k model calls done, the k-th tool
still running) each method predicts every test trajectory's total length:

- progressive: tokens generated so far plus the regressor's remaining tokens, from the context so far;
- prompt_only: the same model trained on, and fed, the prompt alone; a total it has already passed is
  replaced by what has been generated;
- history: the mean total of finished trajectories of the same prompt, else of all (training split).

Each figure comes with a 95% bootstrap interval over the test trajectories, and progressive at step 2 is
compared with each of the others on the same resamples (``step2_against``): with a few dozen test
trajectories the top 10% is a handful, and a recall moves in steps of one trajectory.

Ranking within batches (``loom.bench.predictor_ranking``): on each of the three trace sets (coding, search, tool use)
as the rollout benchmarks replay them, Kendall's tau-b within batches at steps 0, 1, 2 and 5 for what the
predictor serves (the combiner over the text model, history, siblings and step), Loom's text model alone
(cross-fitted by prompt, as ``loom bench rollout`` runs it) and the free heuristics (a group's first finished
sibling, the prompt's previous epoch and the mean of its earlier samples, the prompt's length), each with a
95% interval over batches, recall of the top 10% and Pearson's r beside it, and the combiner fitted on two
trace sets and tested on the third. Beside the served model's gain over the best free heuristic stands what
its forms reach fitted on the very batches they rank (``in_sample_bound``, ``loom.bench.ranking_bound``): an
idealisation, the most a model of its kind could ask of that step's information; and each method's tau over
the pairs of different prompts alone, with what ranking by each prompt's own mean total reaches there
(``between_prompts``, ``prompt_bound``): at admission a prompt's samples cannot be told apart, and the history
heuristics' order within a prompt is this benchmark's construction (``loom.bench.predictor_ranking``).

Latency is the ONNX Runtime call for a batch of 1 and of 32 contexts of 2,048 tokens (``b1``, ``b32``), in a
process of its own as the service runs it, the contexts tokenised beforehand as the service does on each
request's arrival; ``tokenize_per_request`` is what that costs for one step-2 context. What the service
serves adds the combiner on each query of the batch, with what is known of a trajectory at step 2 of the
trace sets (``served_b1``, ``served_b32``; timed interleaved with the text model's, on the same batches), and
runs the text model on only those queries whose estimate reads its total (``served_text_share`` of them), as
the service does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from loom.bench.predictor_ranking import METHODS as RANK_METHODS
from loom.bench.registry import Benchmark
from loom.predict import evaluate
from loom.predict.combine import Combiner, Known

# Steps 0 to 2 as in Heddle's Figure 13 (and the acceptance line); the later ones, over the trajectories that
# reach them, show how far along the context starts to tell the long tail apart.
STEPS = (0, 1, 2, 5, 10, 20)
QUICK_TRACES = 120
# The progressive model's training budget (the prompt-only one gets a third): about six minutes of two cores.
STEPS_BUDGET = 1000
QUICK_STEPS = 60
# Heddle's two measures (§7.3), under the names the JSON gives them.
METRICS = (("recall", evaluate.tail_recall), ("pearson", evaluate.pearson))
# Fewer test trajectories than this (at all, or reaching a step) say nothing about a tail of 10%.
MIN_TRAJECTORIES = 10
# Windows in the latency's larger batch (the service's micro-batch is at most this), one trajectory each.
LATENCY_WINDOWS = 32
# A combiner and what is known of LATENCY_WINDOWS trajectories: what the served latency combines.
Served = tuple[Combiner, list[Known]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", default=None, help="a trace file of the SWE schema (default: the SWE traces)")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a trained progressive checkpoint directory holding model.onnx (default: train one now)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimiser steps (default {STEPS_BUDGET}; --quick {QUICK_STEPS})",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/predictor"), help="checkpoints and ONNX files")


def _percentiles(samples: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(samples) * 1e3
    return {"p50": round(float(np.percentile(ms, 50)), 2), "p99": round(float(np.percentile(ms, 99)), 2)}


def _train(examples: Any, out: Path, steps: int, seed: int, method: str, epochs: int) -> tuple[Path, Any]:
    from loom.predict import train
    from loom.predict.export import export

    cfg = train.TrainConfig(max_steps=steps, seed=seed, epochs=epochs)
    report = train.train(examples["train"], examples["val"], cfg, out)
    return export(out, out / "model.onnx", method), report


def run(args: argparse.Namespace) -> dict[str, Any]:
    from loom.data.traces import load_traces
    from loom.predict import dataset
    from loom.predict.history import HistoryPredictor
    from loom.predict.onnx_model import OnnxRegressor

    console = Console(stderr=True)
    started = time.monotonic()
    traces = list(load_traces(args.traces).values())
    if args.quick:
        traces = traces[:QUICK_TRACES]
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else STEPS_BUDGET)
    data = dataset.build(traces, seed=args.seed)
    prompt_data = {k: [e for e in v if e.step == 0] for k, v in data.items()}
    test_ids = sorted({e.traj_id for e in data["test"]})
    if len(test_ids) < MIN_TRAJECTORIES:
        raise SystemExit(f"only {len(test_ids)} test trajectories; give a trace file with more")
    training: dict[str, Any] = {}
    if args.model is not None:
        progressive = OnnxRegressor(args.model / "model.onnx")
    else:
        path, rep = _train(data, args.out / "progressive", steps, args.seed, "progressive", epochs=30)
        progressive, training["progressive"] = OnnxRegressor(path), vars(rep)
    path, rep = _train(
        prompt_data, args.out / "prompt_only", max(1, steps // 3), args.seed, "prompt_only", epochs=60
    )
    prompt_only, training["prompt_only"] = OnnxRegressor(path), vars(rep)
    history = HistoryPredictor()
    for e in data["train"]:
        if e.step == 0:
            history.observe(e.task_id, e.total)

    by_traj: dict[str, dict[int, dataset.Example]] = {}
    for e in data["test"]:
        by_traj.setdefault(e.traj_id, {})[e.step] = e
    firsts = [by_traj[t][0] for t in test_ids]
    # At step 0 nothing is generated yet: the remaining tokens are the total.
    prompt_totals = dict(zip(test_ids, prompt_only.remaining(firsts), strict=True))
    methods: dict[str, dict[str, dict[str, Any]]] = {"progressive": {}, "prompt_only": {}, "history": {}}
    totals: dict[tuple[str, int], dict[str, float]] = {}
    for k in STEPS:
        ex = [by_traj[t][k] for t in test_ids if k in by_traj[t]]
        if len(ex) < MIN_TRAJECTORIES:
            continue
        actual = [e.total for e in ex]
        rem = progressive.remaining(ex)
        preds = {
            "progressive": [e.generated + r for e, r in zip(ex, rem, strict=True)],
            "prompt_only": [max(float(prompt_totals[e.traj_id]), e.generated) for e in ex],
            "history": [history.predict_total(e.task_id, e.generated) for e in ex],
        }
        for name, p in preds.items():
            totals[name, k] = {e.traj_id: float(v) for e, v in zip(ex, p, strict=True)}
            methods[name][f"step{k}"] = {
                **{m: round(metric(p, actual), 3) for m, metric in METRICS},
                **_intervals(actual, p),
            }
    actual_of = {t: float(by_traj[t][0].total) for t in test_ids}

    held_out = set(test_ids)
    test_traces = [t for t in traces if t.id in held_out]
    ranking, served = _ranking(args.quick, args.seed, console)
    latency = _latency(progressive.path, data["test"], test_traces, 30 if args.quick else 300, served)
    text_share = latency.pop("served_text_share")
    result = {
        "benchmark": "predictor",
        "trajectories": {k: len({e.traj_id for e in v}) for k, v in data.items()},
        "methods": methods,
        "step2_against": _step2_against(totals, actual_of),
        "latency_ms": latency,
        # What serving the combination costs over the text model alone (what the service served before it).
        "served_over_text_p99": {
            b: round(latency[f"served_{b}"]["p99"] / latency[b]["p99"], 3)
            for b in ("b1", f"b{LATENCY_WINDOWS}")
        },
        "served_text_share": text_share,
        "ranking": ranking,
        "training": training,
        "wall_s": round(time.monotonic() - started, 1),
    }
    _print(console, result)
    return result


def _ranking(quick: bool, seed: int, console: Console) -> tuple[dict[str, Any], Served]:
    """Kendall's tau-b within batches per trace set, step and method, with recall and Pearson's r beside it,
    and the served combiner tested on each trace set with the other two alone (``held_out``) and as a first
    epoch knows it (``first_epoch``); and a combiner
    with what is known of ``LATENCY_WINDOWS`` trajectories at step 2, for the served latency."""
    from loom.bench import predictor_ranking as pr
    from loom.bench.harness.learned import cross_fitted
    from loom.bench.harness.served import (
        GROUP,
        QUICK_ROW_PROMPTS,
        ROW_PROMPTS,
        ROW_STEPS,
        fold_combiners,
        known_at,
        row_workloads,
    )
    from loom.bench.rollout import learned_budget

    budget = learned_budget(quick, None, seed)
    prompts = QUICK_ROW_PROMPTS if quick else ROW_PROMPTS
    workloads = row_workloads(prompts, seed)
    # At the combiner's row steps (the ranked ones among them): one pass of the text models serves both.
    learned = {
        n: cross_fitted(w, budget, console.print, steps=ROW_STEPS).totals for n, w in workloads.items()
    }
    served = pr.cross_fitted_served(workloads, learned, budget, prompts)
    held_out, held_out_text = pr.held_out_served(workloads, learned, budget, prompts)
    out: dict[str, Any] = {}
    for name, w in workloads.items():
        out[name] = {
            "trajectories": len(w.trajectories),
            "group": GROUP[name],
            **pr.ranking_report(w, learned[name], served[name], pr.STEPS),
        }
    out["held_out"] = {
        name: pr.ranking_report(w, held_out_text[name], held_out[name], pr.STEPS)
        for name, w in workloads.items()
    }
    first = pr.cross_fitted_served(workloads, learned, budget, prompts, drop=pr.FIRST_EPOCH)
    out["first_epoch"] = {
        name: pr.ranking_report(w, learned[name], first[name], pr.STEPS, drop=pr.FIRST_EPOCH)
        for name, w in workloads.items()
    }
    # Every trace set's trajectories at step 2 in turn (history, siblings, pace: the combiner's dearest cells).
    known = [k for n, w in workloads.items() for k in known_at(w, 2, learned[n]).values()]
    sample = [known[i * len(known) // LATENCY_WINDOWS] for i in range(LATENCY_WINDOWS)]
    return out, (fold_combiners(budget, prompts)[0], sample)


def _intervals(actual: Sequence[float], predicted: Sequence[float]) -> dict[str, list[float]]:
    out = {}
    for name, metric in METRICS:
        iv = evaluate.bootstrap(metric, actual, predicted)
        out[f"{name}_ci95"] = [round(iv.low, 3), round(iv.high, 3)]
    return out


def _step2_against(
    totals: dict[tuple[str, int], dict[str, float]], actual_of: dict[str, float]
) -> dict[str, dict[str, Any]]:
    """Progressive at step 2 against each comparison of acceptance line 1, paired on the trajectories that
    reach step 2: the difference, its 95% bootstrap interval, and the share of resamples progressive wins."""
    if ("progressive", 2) not in totals:
        return {}
    ours = totals["progressive", 2]
    ids = sorted(ours)
    actual = [actual_of[t] for t in ids]
    out: dict[str, dict[str, Any]] = {}
    for name, key in (
        ("step0", ("progressive", 0)),
        ("prompt_only", ("prompt_only", 2)),
        ("history", ("history", 2)),
    ):
        other = [totals[key][t] for t in ids]
        row: dict[str, Any] = {}
        for metric_name, metric in METRICS:
            iv = evaluate.bootstrap(metric, actual, [ours[t] for t in ids], other)
            row[metric_name] = {
                "diff": round(iv.estimate, 3),
                "ci95": [round(iv.low, 3), round(iv.high, 3)],
                "p_better": round(iv.above_zero, 3),
            }
        out[name] = row
    return out


def _latency(
    model_path: Path, examples: Sequence[Any], traces: Sequence[Any], repeats: int, served: Served
) -> dict[str, Any]:
    """The text model's latency (``b1``, ``b32``) and what the service serves, the text model's batch with the
    combiner on each of its queries (``served_b1``, ``served_b32``), interleaved in one process."""
    from loom.bench.predictor_latency import served_input
    from loom.predict import context
    from loom.text.tokenizer import qwen_tokenizer

    # 32 windows of 2,048 tokens (the prompt's head and the context's tail) from the test split.
    full = [e.ids for e in examples if len(e.ids) == context.HEAD_TOKENS + context.TAIL_TOKENS]
    if not full:
        raise SystemExit("no test context fills a 2,048-token window")
    windows = np.stack([full[i % len(full)] for i in range(LATENCY_WINDOWS)])
    path = model_path.parent / "latency-windows.npy"
    np.save(path, windows)
    served_path = model_path.parent / "latency-served.json"
    served_path.write_text(json.dumps(served_input(*served)))
    cmd = [
        sys.executable,
        "-m",
        "loom.bench.predictor_latency",
        str(model_path),
        str(path),
        str(repeats),
        str(served_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    # Tokenising happens per request as it arrives, before batching: what one step-2 context costs.
    tok, times = qwen_tokenizer(), []
    for t in traces[:32]:
        pieces = context.step_pieces([s.action for s in t.steps], [s.observation for s in t.steps], 2)
        t0 = time.perf_counter()
        context.encode(tok, t.task, pieces)
        times.append(time.perf_counter() - t0)
    out["tokenize_per_request"] = _percentiles(times)
    return out


def _print(console: Console, r: dict[str, Any]) -> None:
    t = Table(title=f"Length prediction on the held-out split ({r['trajectories']['test']} trajectories)")
    for col in ("step", "method", "recall (95% CI)", "Pearson r (95% CI)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for k in STEPS:
        for name, steps in r["methods"].items():
            m = steps.get(f"step{k}")
            if m:
                cells = [
                    f"{m[x]:.2f} ({m[f'{x}_ci95'][0]:.2f} to {m[f'{x}_ci95'][1]:.2f})"
                    for x in ("recall", "pearson")
                ]
                t.add_row(str(k), name, *cells, end_section=name == list(r["methods"])[-1])
    console.print(t)
    for name, row in r["step2_against"].items():
        console.print(
            f"progressive step 2 - {name}: "
            + ", ".join(
                f"{m} {v['diff']:+.3f} (95% CI {v['ci95'][0]:+.3f} to {v['ci95'][1]:+.3f}, "
                f"ahead in {v['p_better']:.0%} of resamples)"
                for m, v in row.items()
            )
        )
    for title, ranking in (
        ("", {k: v for k, v in r["ranking"].items() if k not in ("held_out", "first_epoch")}),
        (", the combiner fitted on the other trace sets alone", r["ranking"].get("held_out", {})),
        (", in a first epoch (no earlier samples of a prompt)", r["ranking"].get("first_epoch", {})),
    ):
        t = Table(title=f"Kendall's tau-b within batches of 8 prompts (95% interval over batches){title}")
        cols = ("served - best", "between prompts", "in-sample bound - best", "prompt bound - best, between")
        for col in ("trace set", "step", *RANK_METHODS, *cols):
            t.add_column(col, justify="right")
        for name, rows in ranking.items():
            for step, methods in rows.items():
                if not step.startswith("step"):
                    continue
                vs, bound = methods.get("served_vs_best"), methods.get("in_sample_bound")
                by_prompt = methods.get("prompt_bound") or {}
                t.add_row(
                    name,
                    step[4:],
                    *(
                        f"{methods[m]['tau']:+.2f} ({methods[m]['ci95'][0]:+.2f}..{methods[m]['ci95'][1]:+.2f})"
                        if m in methods
                        else "-"
                        for m in RANK_METHODS
                    ),
                    f"{vs['diff']:+.2f} ({vs['ci95'][0]:+.2f}..{vs['ci95'][1]:+.2f}) vs {vs['best']}"
                    if vs
                    else "-",
                    f"{vs['between_diff']:+.2f}" if vs and "between_diff" in vs else "-",
                    f"{bound['vs_best']:+.2f} ({bound['by']})" if bound else "-",
                    f"{by_prompt['between_vs_best']:+.2f}" if "between_vs_best" in by_prompt else "-",
                )
        console.print(t)
    lat = r["latency_ms"]
    console.print(
        "latency (ONNX Runtime): "
        + ", ".join(f"{k} p50 {v['p50']} ms p99 {v['p99']} ms" for k, v in lat.items())
        + "; served over the text model alone, p99: "
        + ", ".join(f"{k} {v:.3f}x" for k, v in r["served_over_text_p99"].items())
        + f" (the text model run for {r['served_text_share']:.0%} of the served queries)"
    )


BENCHMARK = Benchmark(
    "predictor",
    "progressive length prediction against prompt-only and history-based, and its latency",
    add_arguments,
    run,
)

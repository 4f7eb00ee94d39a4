"""Plots (PNG) and a Markdown report for ``loom bench heddle-suite``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt
import numpy as np

from loom.bench.heddle_suite import EXPERIMENTS, shown

SYSTEM_LABEL = {"heddle": "Loom", "verl": "verl", "verl_star": "verl*", "slime": "slime"}
SHOWN_MODEL = "qwen3-14b"


def write_report(
    out_dir: Path, out: dict[str, Any], drawn: dict[Any, dict[str, Any]], layout: dict[str, Any]
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    images = {
        "overall": _overall(out_dir, out),
        "ablations": _ablations(out_dir, out),
        "active": _active(out_dir, drawn, layout),
        "cdf": _cdf(out_dir, drawn, layout),
        "utilisation": _utilisation(out_dir, drawn, layout),
        "gantt": _gantt(out_dir, drawn, layout),
    }
    path = out_dir / "report.md"
    path.write_text(_markdown(out, images))
    return path


def _save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _overall(d: Path, out: dict[str, Any]) -> str:
    workloads = list(out["overall"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6))
    for ax, w in zip(np.atleast_1d(axes), workloads, strict=True):
        models = list(out["overall"][w])
        x = np.arange(len(models))
        for k, s in enumerate(SYSTEM_LABEL):
            vals = [out["overall"][w][m]["systems"][s]["throughput_tok_s"] for m in models]
            ax.bar(x + (k - 1.5) * 0.2, vals, 0.2, label=SYSTEM_LABEL[s])
        ax.set_xticks(x, [m.replace("qwen3-", "Qwen3-").upper().replace("QWEN3", "Qwen3") for m in models])
        ax.set_title(w)
        ax.set_ylabel("throughput (tokens/s)")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    return _save(fig, d / "overall_throughput.png")


def _ablations(d: Path, out: dict[str, Any]) -> str:
    fig, axes = plt.subplots(1, len(EXPERIMENTS), figsize=(5 * len(EXPERIMENTS), 3.6))
    for ax, exp in zip(axes, EXPERIMENTS, strict=True):
        workloads = list(out[exp])
        variants = list(out[exp][workloads[0]])
        x = np.arange(len(workloads))
        width = 0.8 / len(variants)
        for k, v in enumerate(variants):
            # Normalised to Loom's full configuration (the last variant) per workload.
            vals = [
                out[exp][w][v]["throughput_tok_s"] / max(out[exp][w][variants[-1]]["throughput_tok_s"], 1e-9)
                for w in workloads
            ]
            ax.bar(x + (k - (len(variants) - 1) / 2) * width, vals, width, label=v)
        ax.set_xticks(x, workloads)
        ax.set_title(f"{exp} ({SHOWN_MODEL}, {out['ablation_gpus']} GPUs)")
        ax.set_ylabel("throughput / Loom")
        ax.legend(fontsize=7)
    return _save(fig, d / "ablations.png")


def _main(layout: dict[str, Any], preferred: str = "coding") -> str:
    return shown(list(layout["overall"]), preferred)


def _timeline_cells(drawn: dict[Any, dict[str, Any]], cells: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {label: drawn[c]["timeline"] for label, c in cells.items() if c in drawn}


def _active(d: Path, drawn: dict[Any, dict[str, Any]], layout: dict[str, Any]) -> str:
    panels = {
        f"{_main(layout)}, {SHOWN_MODEL}": _timeline_cells(
            drawn, layout["overall"][_main(layout)][SHOWN_MODEL]
        ),
        f"{_main(layout, 'search')}, {SHOWN_MODEL}, ablation GPUs: resources": _timeline_cells(
            drawn, layout["resources"][_main(layout, "search")]
        ),
    }
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (title, series) in zip(axes, panels.items(), strict=True):
        for label, tl in series.items():
            ts, active = tl["active"]
            ax.plot(ts, active, label=SYSTEM_LABEL.get(label, label))
        ax.set_title(title)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("active trajectories")
        ax.legend(fontsize=8)
    return _save(fig, d / "active_trajectories.png")


def _cdf(d: Path, drawn: dict[Any, dict[str, Any]], layout: dict[str, Any]) -> str:
    workloads = list(layout["overall"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6))
    for ax, w in zip(np.atleast_1d(axes), workloads, strict=True):
        for label, tl in _timeline_cells(drawn, layout["overall"][w][SHOWN_MODEL]).items():
            fin = np.asarray(tl["finish_s"])
            ax.plot(fin, np.arange(1, len(fin) + 1) / len(fin), label=SYSTEM_LABEL[label])
        ax.set_title(f"{w}, {SHOWN_MODEL}")
        ax.set_xlabel("trajectory completion time (s)")
        ax.set_ylabel("CDF")
        ax.legend(fontsize=8)
    return _save(fig, d / "completion_cdf.png")


def _utilisation(d: Path, drawn: dict[Any, dict[str, Any]], layout: dict[str, Any]) -> str:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for label, tl in _timeline_cells(drawn, layout["overall"][_main(layout)][SHOWN_MODEL]).items():
        ts, rate = tl["throughput"]
        ax.plot(ts, rate, label=SYSTEM_LABEL[label])
    ax.set_title(f"{_main(layout)}, {SHOWN_MODEL}: cluster generation rate")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    return _save(fig, d / "utilisation.png")


def _gantt(d: Path, drawn: dict[Any, dict[str, Any]], layout: dict[str, Any]) -> str:
    series = _timeline_cells(drawn, layout["overall"][_main(layout)][SHOWN_MODEL])
    shown = [s for s in ("heddle", "slime") if s in series]
    fig, axes = plt.subplots(len(shown), 1, figsize=(9, 2.2 * max(1, len(shown))), squeeze=False)
    for ax, s in zip(axes[:, 0], shown, strict=True):
        # One row per worker: each step's span from submission to completion, coloured by trajectory.
        by_worker: dict[int, list[tuple[float, float, int]]] = {}
        for w, a, b, i in series[s]["gantt"]:
            by_worker.setdefault(w, []).append((a, b - a, i))
        for w, bars in by_worker.items():
            colours = [plt.cm.tab20(i % 20) for _, _, i in bars]
            ax.broken_barh([(a, span) for a, span, _ in bars], (w - 0.4, 0.8), facecolors=colours, alpha=0.5)
        ax.set_yticks(sorted(by_worker))
        ax.set_title(f"{SYSTEM_LABEL[s]}: steps on the first workers (coding, {SHOWN_MODEL})")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("worker")
    return _save(fig, d / "gantt.png")


def _markdown(out: dict[str, Any], images: dict[str, str]) -> str:
    tg = out["target"]
    last = tg["last_finisher"]
    lines = [
        "# Heddle suite",
        "",
        f"{out['gpus']} GPUs per cell, {out['cells']} rollouts in virtual time on the calibrated engine model, "
        f"wall {out.get('wall_s', '?')} s.",
        "",
        "## Overall (Heddle Figure 12)",
        "",
        f"Loom runs its learned predictor ({out.get('predictor', 'learned')}, cross-fitted by prompt); the last "
        "three columns are Loom on exact lengths (an oracle: an idealisation, not a result).",
        "",
        "| workload | model | Loom tok/s | verl tok/s | verl* tok/s | slime tok/s | x verl | x verl* | x slime "
        "| Loom makespan/LB | oracle tok/s | oracle x slime | oracle makespan/LB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, by_model in out["overall"].items():
        for m, r in by_model.items():
            s = r["systems"]
            sp = r["speedup"]
            lines.append(
                f"| {w} | {m} | {s['heddle']['throughput_tok_s']:,.0f} | {s['verl']['throughput_tok_s']:,.0f} "
                f"| {s['verl_star']['throughput_tok_s']:,.0f} | {s['slime']['throughput_tok_s']:,.0f} "
                f"| {sp['verl']:.2f} | {sp['verl_star']:.2f} | {sp['slime']:.2f} | {r['makespan_over_lb']:.2f} "
                f"| {r['oracle']['throughput_tok_s']:,.0f} | {r['oracle']['speedup']['slime']:.2f} "
                f"| {r['oracle']['makespan_over_lb']:.2f} |"
            )
    lines += [
        "",
        f"![overall]({images['overall']})",
        "",
        f"**Target** ({tg['cell']}): x slime {tg['vs_slime']} (want >= {tg['want']['vs_slime']}), "
        f"x best baseline {tg['vs_best_baseline']} (want >= {tg['want']['vs_best_baseline']}), "
        f"makespan/LB {tg['makespan_over_lb']} (want <= {tg['want']['makespan_over_lb']}).",
        "",
        f"Every cell over its best baseline: at least {out.get('min_ratio_vs_best')}x (want >= 1.2); the learned "
        f"predictor keeps at least {out.get('min_learned_share')} of the oracle's gain (want >= 0.8). No "
        "system can beat a cell's best baseline by more than that baseline's makespan over LB: "
        + ", ".join(
            f"{w} {m} {r['ceiling_vs_best']}x" for w, by_m in out["overall"].items() for m, r in by_m.items()
        )
        + ".",
        "",
        "### The tail",
        "",
        "The share of the makespan spent finishing the last 10% of trajectories (Seer's long-tail measure), and "
        "the share of slime's tail seconds Loom cuts.",
        "",
        "| workload | model | Loom | verl | verl* | slime | tail cut vs slime |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {w} | {m} | "
            + " | ".join(f"{r['tail_share'][x]:.0%}" for x in ("heddle", "verl", "verl_star", "slime"))
            + f" | {r.get('tail_cut_vs_slime', float('nan')):.0%} |"
            for w, by_model in out["overall"].items()
            for m, r in by_model.items()
        ),
        "",
        "LB is the larger of the longest trajectory's critical path (batch 1, best degree, no queueing) and all "
        "the work (decodes reading their context, observations prefilled) in as few iterations as the batch "
        "limit and KV cache allow on the best degree; `loom.bench.harness.bounds` says why no schedule beats it.",
        "",
        "Formula 1 for the trajectory that finished last under Loom (queueing, base per-token time x tokens, "
        f"interference on top of it, tool time), seconds: {tg['makespan_breakdown']}. How it was ranked: "
        f"{last['longer']} trajectories were longer, its first call was ranked below {last['ranked_above']}, "
        f"and waited {last['first_call_queueing_s']} s of its {last['queueing_s']} s queueing.",
        "",
        "## Ablations (Heddle Figures 13-16)",
        "",
        f"Qwen3-14B on {out['ablation_gpus']} GPUs, 100 trajectories per baseline worker; each variant changes one "
        "part of Loom's policy and keeps the rest.",
        "",
    ]
    for exp in EXPERIMENTS:
        variants = list(next(iter(out[exp].values())))
        lines += [
            f"### {exp}",
            "",
            "| workload | " + " | ".join(variants) + " |",
            "|---|" + "---|" * len(variants),
        ]
        for w, runs in out[exp].items():
            cells = [
                f"{runs[v]['throughput_tok_s']:,.0f} tok/s, {runs[v]['makespan_s']:,.0f} s, "
                f"longest queued {runs[v]['longest_traj_queueing_s']:,.0f} s"
                for v in variants
            ]
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
        lines.append("")
        if exp == "prediction":
            kept = ", ".join(f"{w} {v}" for w, v in out["learned_keeps_of_oracle_gain"].items())
            seer = ", ".join(f"{w} {v}" for w, v in out["learned_keeps_of_clairvoyant_gain"].items())
            lines += [
                f"Share of the oracle's gain over no prediction that the learned model keeps: {kept}. The "
                "oracle knows each trajectory exactly and each tool's latency at its mean; the clairvoyant "
                f"knows the latency draws too, which no predictor can (its gain kept: {seer}).",
                "",
            ]
            lines += [
                "| workload | step | recall of the top 10% (95% CI) | Pearson r (95% CI) |",
                "|---|---|---|---|",
            ]
            for w, q in out.get("prediction_quality", {}).items():
                for k in ("step0", "step2"):
                    if k in q:
                        r, p = q[k]["recall"], q[k]["pearson"]
                        lines.append(
                            f"| {w} | {k[4:]} | {r['estimate']} ({r['ci95'][0]} to {r['ci95'][1]}) "
                            f"| {p['estimate']} ({p['ci95'][0]} to {p['ci95'][1]}) |"
                        )
            lines.append("")
    if "drafting" in out:
        lines += _drafting(out)
    lines += [
        f"![ablations]({images['ablations']})",
        "",
        "## Timelines",
        "",
        f"![active trajectories]({images['active']})",
        "",
        f"![completion CDF]({images['cdf']})",
        "",
        f"![utilisation]({images['utilisation']})",
        "",
        f"![gantt]({images['gantt']})",
        "",
    ]
    return "\n".join(lines)


def _drafting(out: dict[str, Any]) -> list[str]:
    """Every overall cell again on drafting engines (``--speculative``): shared and per-engine corpora."""
    lines = [
        "## Drafting engines (speculative decoding from the group, the earlier epoch and the context)",
        "",
        "Each workload's rates were measured on its recorded traces (`loom bench speculative`): "
        + ", ".join(
            f"{w} {r['positions']:.2f} positions and {r['tokens_per_step']:.2f} tokens kept per step"
            for w, r in out["speculation"].items()
        )
        + ". Ceiling: Loom's plain makespan over its longest trajectory alone on a drafting engine at those "
        "rates, which no schedule beats.",
        "",
        "| workload | model | Loom with / without | verl | verl* | slime | Loom x best baseline | ceiling "
        "| own corpora: Loom with / without | Loom x best baseline | tokens beside a sibling, Loom |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, by_model in out["drafting"].items():
        for m, r in by_model.items():
            g, loc = r["gain"], out["local_corpus"][w][m]
            lines.append(
                f"| {w} | {m} | {g['heddle']:.2f} | {g['verl']:.2f} | {g['verl_star']:.2f} | {g['slime']:.2f} "
                f"| {r['vs_best_baseline']:.2f} | {r['gain_ceiling']:.2f} | {loc['gain']['heddle']:.2f} "
                f"| {loc['vs_best_baseline']:.2f} | {loc['sibling_local_share']['heddle']:.0%} |"
            )
    return [*lines, ""]

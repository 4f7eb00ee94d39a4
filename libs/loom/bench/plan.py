"""``loom plan``: what Loom would do with a workload on a cluster, before anyone buys the GPUs.

The workload (built in, or a rollout-trace file) runs in the benchmarks' harness, in virtual time on the
calibrated engine model, at the cluster asked for and at a sweep of sizes around it, under Loom's policy
and each baseline's: the model-parallel layout Loom's allocator chooses, each system's makespan,
throughput and tail share, and the size beyond which the workload stops speeding up. That size is where
the lower bound's throughput term (all the work over the cluster's best rate, which halves as the GPUs
double) meets its critical path (the longest trajectory alone on the fastest worker, which no GPU count
shortens), and, measured, the smallest size of the sweep within 5% of the best makespan (None where the
largest size is still more than 5% faster than the one before: it saturates beyond the sweep).

The plan's figures at the size asked for are a run of ``loom bench rollout`` on that cluster: the same
workload, predictor, policies and seed give the same makespan.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from loom.bench.harness.cluster import Cluster
from loom.bench.harness.learned import Learned
from loom.bench.harness.rollout import RolloutResult, run_rollout
from loom.protocol import PolicySpec
from loom.workloads import Workload

SYSTEMS = ("heddle", "verl", "verl_star", "slime")
FIGURES = ("makespan_s", "throughput_tok_s", "tail_share", "makespan_over_lb")
# The sweep: the size asked for, halved and doubled, in whole 8-GPU nodes (never below one), so that every
# baseline's MP splits each size.
SWEEP = (0.125, 0.25, 0.5, 1.0, 2.0)
MIN_GPUS = 8
# The measured saturation: the smallest size within this much of the best makespan of the sweep.
FLAT = 0.05


def sweep_sizes(gpus: int) -> list[int]:
    return sorted({max(MIN_GPUS, int(gpus * f) // MIN_GPUS * MIN_GPUS) for f in SWEEP if f != 1.0} | {gpus})


def plan(
    workload: Workload,
    cluster: Cluster,
    predictor: str,
    learned: Learned | None = None,
    seed: int = 0,
    systems: Sequence[str] = SYSTEMS,
    sizes: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Every system at every size of the sweep; the figures at ``cluster.gpus`` and where it saturates."""
    sizes = sorted(set(sizes or sweep_sizes(cluster.gpus)) | {cluster.gpus})
    runs: dict[int, dict[str, Any]] = {}
    for g in sizes:
        at = Cluster(gpus=g, gpu=cluster.gpu, model=cluster.model, tool_s=cluster.tool_s)
        runs[g] = {
            s: run_rollout(
                workload,
                msgspec.convert({"preset": s}, PolicySpec).resolved(),
                at,
                predictor,
                seed,
                learned=learned,
            )
            for s in systems
        }
    here = runs[cluster.gpus]
    loom = here[systems[0]]
    terms = loom.bound_terms
    # Where the throughput term (inversely proportional to the GPUs) falls to the critical path.
    bound_gpus = (
        cluster.gpus * terms["throughput_s"] / terms["critical_path_s"] if terms["critical_path_s"] else 0.0
    )
    best = min(runs[g][systems[0]].makespan_s for g in sizes)
    flat: int | None = min(g for g in sizes if runs[g][systems[0]].makespan_s <= best * (1 + FLAT))
    if flat == sizes[-1] and len(sizes) > 1:
        flat = None  # still speeding up at the largest size of the sweep: it saturates beyond it
    return {
        "gpus": cluster.gpus,
        "gpu": cluster.gpu,
        "model": cluster.model,
        "trajectories": len(workload.trajectories),
        "groups": workload.groups,
        "predictor": predictor,
        "layout": {
            "workers": len(loom.degrees),
            "degrees": {str(d): n for d, n in sorted(Counter(loom.degrees).items(), reverse=True)},
        },
        "systems": {s: _figures(r) for s, r in here.items()},
        "speedup_vs": {
            s: round(r.makespan_s / loom.makespan_s, 3) for s, r in here.items() if s != systems[0]
        },
        "lower_bound_s": round(loom.lower_bound_s, 1),
        "critical_path_s": round(terms["critical_path_s"], 1),
        "saturation_gpus": {
            # A power of two: the next cluster size at which more GPUs no longer shorten the bound.
            "bound": max(MIN_GPUS, 2 ** math.ceil(math.log2(bound_gpus))) if bound_gpus >= 1 else MIN_GPUS,
            "bound_exact": round(bound_gpus, 1),
            "measured": flat,
        },
        "sweep": {
            "gpus": sizes,
            "makespan_s": {s: [round(runs[g][s].makespan_s, 1) for g in sizes] for s in systems},
            "throughput_tok_s": {s: [round(runs[g][s].throughput_tok_s, 1) for g in sizes] for s in systems},
        },
    }


def _figures(r: RolloutResult) -> dict[str, Any]:
    """The run's figures a plan reports, as ``loom bench rollout`` rounds them."""
    summary = r.summary()
    return {k: summary[k] for k in FIGURES}


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    """Makespan against GPU count for every system (log-log), the bound's saturation marked."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    sweep = result["sweep"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s, ys in sweep["makespan_s"].items():
        ax.plot(sweep["gpus"], ys, marker="o", label=s)
    saturates = result["saturation_gpus"]["bound_exact"]
    if sweep["gpus"][0] <= saturates <= sweep["gpus"][-1]:
        ax.axvline(saturates, color="grey", ls="--", lw=1, label="bound saturates")
    elif saturates < sweep["gpus"][0]:
        title += f"\nthe bound saturates below {sweep['gpus'][0]} GPUs: its critical path sets it"
    else:
        title += f"\nthe bound saturates at {saturates:,.0f} GPUs"
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sweep["gpus"], [str(g) for g in sweep["gpus"]])
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("GPUs")
    ax.set_ylabel("makespan (s)")
    ax.set_title(title, fontsize=10)  # two lines: the workload, then where it saturates
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Plots of co-scheduling runs: cost and GPUs over time per policy, and a Gantt of one group's phases."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI

import matplotlib.pyplot as plt

from loom.bench.harness.cosched import Outcome

# (lane, job, phase, start s, end s): a lane is "train" or "rollout node N"
GanttRow = tuple[str, str, str, float, float]


def cost_and_gpus(path: Path, outcomes: Mapping[str, Outcome], t0: float) -> Path:
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, o in outcomes.items():
        hours = [(t - t0) / 3600.0 for t, *_ in o.timeline]
        for ax, col in zip(axes, (1, 2, 3), strict=True):
            ax.step(hours, [row[col] for row in o.timeline], where="post", label=name, linewidth=1.2)
    for ax, label in zip(axes, ("cost ($/h)", "rollout GPUs (H20)", "training GPUs (H800)"), strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=len(outcomes), fontsize=8)
    axes[-1].set_xlabel("time (h)")
    fig.suptitle("Provisioning cost and GPUs over time per co-scheduling policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gantt(path: Path, rows: Sequence[GanttRow], title: str) -> Path:
    lanes = sorted({r[0] for r in rows}, key=lambda lane: (lane != "train", lane))
    jobs = sorted({r[1] for r in rows})
    colours = {j: plt.get_cmap("tab10")(i % 10) for i, j in enumerate(jobs)}
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(lanes)))
    for lane, job, phase, start, end in rows:
        y = lanes.index(lane)
        tail = phase == "tail"  # a migrated long tail: a sliver of the node, below the next rollout
        ax.barh(
            y + (0.3 if tail else 0.0),
            end - start,
            left=start,
            height=0.25 if tail else 0.8,
            color=colours[job],
            edgecolor="black",
            linewidth=0.4,
            hatch="//" if tail else None,
        )
        if end - start > 0 and not tail:
            ax.text((start + end) / 2, y, job, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The plot of a ``loom train`` run: batch reward and staleness against step and wall time, per mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot(modes: list[Any], path: Path, target: float | None = None) -> None:
    """``target``: a reward to draw across the reward plots (the random player's, for coin)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for m in modes:
        label = f"async_bound {m.async_bound}"
        steps = [s["step"] for s in m.steps]
        axes[0].plot(steps, [s["reward"] for s in m.steps], marker="o", label=label)
        axes[1].plot([s["wall_s"] for s in m.steps], [s["reward"] for s in m.steps], marker="o", label=label)
        axes[2].plot(steps, [s["staleness_mean"] for s in m.steps], marker="o", label=f"{label}: mean")
        axes[2].plot(steps, [s["staleness_max"] for s in m.steps], ls="--", label=f"{label}: max")
        if m.eval_first and m.eval_last:
            for ax, x0, x1 in ((axes[0], 0, steps[-1] if steps else 1), (axes[1], 0, m.wall_s)):
                y0 = sum(m.eval_first.values()) / len(m.eval_first)
                y1 = sum(m.eval_last.values()) / len(m.eval_last)
                ax.plot([x0, x1], [y0, y1], "k*--", ms=12, label=f"{label}: held-out eval")
    if target is not None:
        for ax in axes[:2]:
            ax.axhline(target, color="grey", ls=":", label=f"random play ({target:.2f})")
    axes[0].set(xlabel="step", ylabel="mean reward of the batch", title="reward by step")
    axes[1].set(
        xlabel="wall seconds since the stream opened", ylabel="mean reward", title="reward by wall time"
    )
    axes[2].set(xlabel="step", ylabel="versions behind the policy", title="staleness of trained samples")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

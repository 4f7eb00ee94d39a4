"""One run of the training-step harness as a benchmark cell (picklable, for a process pool), and the split of
its step time into terms."""

from __future__ import annotations

import argparse
import functools
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.bench.harness.training import Mode, Pool, run_training
from loom.bench.workload_mix import mixed
from loom.engine.model.train_perf import TrainStage
from loom.workloads.base import Workload

# RollArt §7.1: rollout tensor parallelism per model.
TP = {"qwen3-8b": 1, "qwen3-14b": 2, "qwen3-32b": 4}
TERMS = ("wait_s", "train_s", "sync_s")
TERM_NAMES = {"wait_s": "rollout (waiting for the batch)", "train_s": "training", "sync_s": "weight sync"}


@dataclass(frozen=True)
class Cell:
    model: str
    mode: Mode
    rollout: tuple[Pool, ...]
    train_gpus: int
    batch_groups: int
    steps: int
    warmup: int
    seed: int
    label: str = ""
    affinity: tuple[tuple[str, str], ...] = ()


@functools.cache
def mix_workload(seed: int) -> Workload:
    """The mix, loaded once per process (about a second of trace parsing; the harness only reads it)."""
    return mixed(group_size=8, seed=seed)


def run_cell(c: Cell) -> dict[str, Any]:
    r = run_training(
        mix_workload(c.seed),
        c.model,
        list(c.rollout),
        TrainStage(c.model, "h800", c.train_gpus),
        c.mode,
        c.batch_groups,
        c.steps,
        c.warmup,
        seed=c.seed,
        affinity=dict(c.affinity) or None,
    )
    out = r.summary()
    out["model"] = c.model
    out["alpha"] = c.mode.alpha
    out["label"] = c.label or c.mode.name
    step = r.step_time_s or 1.0
    shares = {k: out[k] / step for k in TERMS}
    out["limited_by"] = TERM_NAMES[max(shares, key=lambda k: shares[k])]
    out["shares"] = {k: round(v, 3) for k, v in shares.items()}
    # Batches of the first groups to finish hold shorter trajectories: per trained token is the fair rate.
    out["trained_tokens_per_s"] = round(r.trained_tokens / step)
    return out


def add_run_arguments(p: argparse.ArgumentParser, name: str, quick: tuple[int, int]) -> None:
    """The flags every training-step benchmark takes; ``quick`` is its (steps, warm-up) under --quick."""
    p.add_argument("--models", default="qwen3-8b,qwen3-14b,qwen3-32b")
    p.add_argument(
        "--batch-groups", type=int, default=64, help="groups of 8 per batch (RollArt: 512 samples)"
    )
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default 12, quick {quick[0]})")
    p.add_argument("--warmup", type=int, default=None, help=f"steps not timed (default 4, quick {quick[1]})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="processes")
    p.add_argument("--out", type=Path, default=Path(f"bench-out/{name}"), help="report and plots")
    p.add_argument("--no-plots", action="store_true")


def run_plan(args: argparse.Namespace, quick: tuple[int, int]) -> tuple[list[str], int, int]:
    """Models, steps and warm-up steps of a run: Qwen3-8B alone and ``quick``'s counts under --quick."""
    models = ["qwen3-8b"] if args.quick else args.models.split(",")
    steps = args.steps or (quick[0] if args.quick else 12)
    warmup = args.warmup if args.warmup is not None else (quick[1] if args.quick else 4)
    return models, steps, warmup


def run_cells(cells: list[Cell], workers: int) -> list[dict[str, Any]]:
    with ProcessPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(run_cell, cells))

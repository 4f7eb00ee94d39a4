"""Loom's own hardware-affinity mapping (RollArt §4.1 leaves it to the user): which GPU type each task of a
multi-task job should run on, chosen from the engine model.

Two facts about a task on a GPU type decide it, both from the calibrated performance model:

- its tail floor: its slowest trajectory alone on one engine of that type (prefills, decodes and tools;
  ``bounds.Alone``). A synchronous step can end no sooner than the slowest floor of its tasks.
- its cost: its trajectories' engine time summed at batch 1, times the engine's GPUs and their price
  (RollArt Table 2: an H800 costs 2.85 H20). Decoding is memory-bound at the batch sizes agents run, so
  this ranks the types by what a token of that task costs.

The task with the highest floor (the critical task) goes where its floor is lowest: the step waits for it.
Every other task goes where it costs least among the types on which its own floor stays below the critical
task's, so that moving it cannot make it the new tail. The mapping's default is the type most other tasks
chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loom.bench.harness.bounds import Alone
from loom.engine.model.perf import PerfModel
from loom.workloads.base import WorkTraj

# RollArt Table 2, relative price per GPU.
PRICE = {"h20": 1.0, "h800": 2.85}


@dataclass(frozen=True)
class TaskOnGpu:
    floor_s: float
    cost: float  # price-weighted engine seconds of all the task's trajectories at batch 1


@dataclass(frozen=True)
class Choice:
    affinity: dict[str, str]
    critical: str
    table: dict[str, dict[str, TaskOnGpu]]  # task -> GPU type -> figures
    reasons: list[str]


def choose_affinity(trajectories: Iterable[WorkTraj], model: str, pools: Mapping[str, int]) -> Choice:
    """``pools``: GPU type -> tensor parallelism of its engines. Every GPU type needs a ``PRICE``."""
    if not pools:
        raise ValueError("no GPU types to choose from")
    missing = [g for g in pools if g not in PRICE]
    if missing:
        raise ValueError(f"no price for GPU types {missing}; known: {sorted(PRICE)}")
    alone = {g: Alone(PerfModel(g, model, tp)) for g, tp in pools.items()}
    by_task: dict[str, list[WorkTraj]] = {}
    for t in trajectories:
        by_task.setdefault(t.task, []).append(t)
    if not by_task:
        raise ValueError("no trajectories")
    table: dict[str, dict[str, TaskOnGpu]] = {}
    for task, trajs in by_task.items():
        table[task] = {}
        for g, a in alone.items():
            floor = max(a(t) for t in trajs)
            cost = sum(a.engine(t) for t in trajs) * pools[g] * PRICE[g]
            table[task][g] = TaskOnGpu(floor, cost)
    critical = max(table, key=lambda k: min(v.floor_s for v in table[k].values()))
    home = min(table[critical], key=lambda g: table[critical][g].floor_s)
    bound = table[critical][home].floor_s
    affinity = {critical: home}
    reasons = [
        f"{critical} sets the step's tail: its slowest trajectory alone takes "
        + ", ".join(f"{v.floor_s:.0f} s on {g}" for g, v in table[critical].items())
        + f"; it goes to {home}"
    ]
    for task, row in table.items():
        if task == critical:
            continue
        safe = [g for g, v in row.items() if v.floor_s <= bound] or [min(row, key=lambda g: row[g].floor_s)]
        pick = min(safe, key=lambda g: row[g].cost)
        affinity[task] = pick
        reasons.append(
            f"{task} costs "
            + ", ".join(f"{v.cost / row[pick].cost:.2f}x on {g}" for g, v in row.items())
            + f" of its cheapest; it goes to {pick}, where its own tail is {row[pick].floor_s:.0f} s"
        )
    others = Counter(g for t, g in affinity.items() if t != critical)
    default = others.most_common(1)[0][0] if others else home
    mapping = {t: g for t, g in affinity.items() if g != default}
    mapping["default"] = default
    return Choice(mapping, critical, table, reasons)

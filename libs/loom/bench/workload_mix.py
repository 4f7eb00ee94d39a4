"""A multi-task workload, as RollArt trains on (§7.1): coding, search and tool use in one data set, sampled
in a uniform ratio, every trajectory tagged with its task and cut at the 32K context."""

from __future__ import annotations

import dataclasses

from loom.workloads.base import ROLLART_CONTEXT, Workload, WorkTraj, cap_context
from loom.workloads.coding import coding
from loom.workloads.search import search
from loom.workloads.tooluse import tool_use

LOADERS = {"coding": coding, "search": search, "tool_use": tool_use}


def mixed(
    tasks: tuple[str, ...] = tuple(LOADERS),
    prompts: int | None = None,
    group_size: int = 8,
    seed: int = 0,
    max_context: int = ROLLART_CONTEXT,
) -> Workload:
    """As many groups of ``group_size`` of each task (at most ``prompts``; as many as the smallest trace
    holds), interleaved task by task so that any run of groups mixes the tasks evenly; each trajectory's
    ``task`` names its loader."""
    unknown = set(tasks) - set(LOADERS)
    if unknown or not tasks:
        raise ValueError(f"unknown tasks {sorted(unknown)}; known: {sorted(LOADERS)}")
    per_task: list[list[list[WorkTraj]]] = []
    for name in tasks:
        w = LOADERS[name](prompts=prompts, group_size=group_size, seed=seed)
        groups: dict[str, list[WorkTraj]] = {}
        for t in w.trajectories:
            steps = cap_context(t.steps, max_context)
            if steps:
                groups.setdefault(t.prompt, []).append(
                    dataclasses.replace(
                        t, id=f"{name}/{t.id}", prompt=f"{name}/{t.prompt}", steps=steps, task=name
                    )
                )
        per_task.append(list(groups.values()))
    out = Workload("+".join(tasks), __doc__ or "")
    for round_ in zip(*per_task, strict=False):  # the shortest task list sets the count
        for group in round_:
            out.trajectories.extend(group)
    return out

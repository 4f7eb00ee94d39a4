"""A verl batch as one Loom job: a group per distinct prompt, its samples the prompt's ``rollout.n`` repeats.

verl repeats each prompt ``rollout.n`` times (``DataProto.repeat(interleave=True)``) after giving it a ``uid``,
which is how its GRPO finds a prompt's group; Loom groups the same rows. A row's task is its ``loom_task``
column (a task id of ``loom.dataset``, or a ``{"id", "data"}`` task) when the dataset has one, else its chat
messages (``raw_prompt``) handed to the environment as the task's ``messages``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from loom.integrations.verl.config import plain


@dataclass(frozen=True)
class JobPlan:
    tasks: list[dict[str, Any]]
    group_size: int
    # Row i of the batch is Loom's trajectory (group, sample) = slots[i].
    slots: list[tuple[int, int]]


def task_of(row: Mapping[str, Any], dataset: str | None) -> dict[str, Any]:
    """One row's Loom task; one given by its messages has no id yet (``""``: its group names it)."""
    task = plain(row.get("loom_task"))
    if isinstance(task, Mapping) and "id" in task:
        return {"id": str(task["id"]), "data": dict(task.get("data") or {})}
    if isinstance(task, str):
        return {"id": task, "data": {"set": dataset} if dataset else {}}
    if task is not None:
        raise TypeError(f"loom_task is a task id or a {{'id', 'data'}} task, not {type(task).__name__}")
    messages = plain(row.get("raw_prompt"))
    if isinstance(messages, str):
        return {"id": "", "data": {"prompt": messages}}
    if isinstance(messages, list):
        return {"id": "", "data": {"messages": messages}}
    raise ValueError("a row names its task in a loom_task column or carries its chat messages in raw_prompt")


def plan(non_tensor: Mapping[str, np.ndarray], rows: int, dataset: str | None) -> JobPlan:
    """Group the batch's rows (by ``uid``, else by equal task) into one job's groups of equal size.

    Groups of unequal size (a validation batch that verl padded by repeating its first rows) become a group of
    one per row: a Loom job has one group size."""
    columns = {k: v for k, v in non_tensor.items() if len(v) == rows}
    tasks = [task_of({k: v[i] for k, v in columns.items()}, dataset) for i in range(rows)]
    if "uid" in columns:
        keys = [str(u) for u in columns["uid"]]
    else:
        keys = [json.dumps(t, sort_keys=True) for t in tasks]
    if len(set(Counter(keys).values())) > 1:
        keys = [str(i) for i in range(rows)]
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    group = {k: g for g, k in enumerate(sorted(first, key=first.__getitem__))}
    seen: Counter[str] = Counter()
    slots = []
    for k in keys:
        slots.append((group[k], seen[k]))
        seen[k] += 1
    named = [{**tasks[first[k]], "id": tasks[first[k]]["id"] or f"p{g}"} for k, g in group.items()]
    return JobPlan(named, rows // max(len(group), 1), slots)

"""A library adapter as small as one can be (loom.envs.adapters.Adapter): what adding a library takes is this
file and one entry in loom.envs.registry.KINDS. Its tasks are 'say N' for N below ``size``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loom.envs.actions import ToolCall
from loom.envs.adapters import BadParams, UnknownName
from loom.envs.base import Observation

PACKAGE = "toy"
EXTRA = "toy"


def params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    if name != "say":
        raise UnknownName(f"toy has no environment {name!r}")
    if set(given) - {"size"}:
        raise BadParams(f"toy's say takes size, not {sorted(set(given) - {'size'})}")
    return {"size": 3, **given}


def task_ids(name: str, params: Mapping[str, Any]) -> list[str]:
    return [str(i) for i in range(int(params["size"]))]


def task(name: str, params: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    if task_id not in task_ids(name, params):
        raise KeyError(task_id)
    return {"question": f"say {task_id}", "answer": task_id}


def statement(record: Mapping[str, Any]) -> str:
    return str(record["question"])


def reference_actions(record: Mapping[str, Any]) -> list[str]:
    return [f"Finish[{record['answer']}]"]


class Say:
    name = "toy"

    def __init__(self, record: dict[str, Any]) -> None:
        self.record, self.said = record, ""

    async def reset(self) -> str:
        return statement(self.record)

    async def step(self, call: ToolCall) -> Observation:
        self.said = str(call.arguments.get("input"))
        return Observation("ok", done=True)

    def reference_actions(self) -> list[str]:
        return reference_actions(self.record)

    def verdict(self) -> dict[str, Any]:
        return {"score": float(self.said == self.record["answer"])}

    async def close(self) -> None:
        pass


def make(name: str, params: Mapping[str, Any], task_id: str, timeout_s: float) -> Say:
    return Say(task(name, params, task_id))

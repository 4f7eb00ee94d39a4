"""``reasoning_gym:<dataset>``: reasoning-gym's procedural datasets (``pip install 'loom[reasoning_gym]'``).

A job's tasks are the items of ``reasoning_gym.create_dataset(dataset, **env_params)``, by index (ids ``"0"``
to ``str(size - 1)``; ``size`` is the dataset's default unless given). Items are generated from the seed, so
``seed`` is fixed (0) unless given: the scheduler, every environment manager and the reward service then see
the same items. The model is given the item's question as the built-in environments give a problem (plain
text, encoded once; its replies are kept as the engine's token ids) and answers with ``Finish[answer]`` or a
``finish`` tool call; the dataset's own ``score_answer`` scores the answer, and that score is the reward.
Scripted rollouts answer with the item's own answer.

The library's code runs in a thread under the job's ``tool_timeout_s``: an exception or a timeout there
fails that trajectory alone, with the reason (``LibraryError``, not retried: it would fail or hang again).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from loom.envs.actions import ToolCall, json_call
from loom.envs.adapters import BadParams, LibraryError, LibraryMissing, UnknownName, in_thread
from loom.envs.base import Observation, unknown_tool

PACKAGE = "reasoning-gym"
EXTRA = "reasoning_gym"
TOOLS = ("finish",)
SEED = 0
# As many tasks as a job may take from a data set (DatasetRef.limit).
MAX_SIZE = 100_000
SYSTEM = "Answer the question. When you know the answer, reply Finish[answer] with the answer alone.\n"
T = TypeVar("T")


def _library() -> Any:
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as e:
        raise LibraryMissing(
            f"reasoning_gym environments need the {PACKAGE} package: pip install 'loom[{EXTRA}]' ({e})"
        ) from e


def names() -> list[str]:
    """The datasets reasoning-gym registers."""
    _library()
    return sorted(importlib.import_module("reasoning_gym.factory").DATASETS)


def params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    known = names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UnknownName(f"reasoning-gym has no dataset {name!r}{hint}; it has {', '.join(known)}")
    out = {"seed": SEED, **given}
    size = len(_dataset(name, _key(out)))  # the library checks the parameters as it builds the dataset
    if size > MAX_SIZE:
        raise BadParams(f"size {size} is more tasks than a job may have ({MAX_SIZE})")
    return out


def _key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, key: str) -> Any:
    lib = _library()
    try:
        return lib.create_dataset(name, **json.loads(key))
    except Exception as e:  # its config classes raise TypeError, AssertionError, ValueError, ...
        raise BadParams(
            f"reasoning-gym's {name} does not take these env_params: {type(e).__name__}: {e}"
        ) from e


def task_ids(name: str, params: Mapping[str, Any]) -> list[str]:
    return [str(i) for i in range(len(_dataset(name, _key(params))))]


def task(name: str, params: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    ds = _dataset(name, _key(params))
    if not task_id.isdigit() or int(task_id) >= len(ds):
        raise KeyError(f"reasoning-gym's {name} has no task {task_id!r} (ids 0 to {len(ds) - 1})")
    try:
        return dict(ds[int(task_id)])
    except Exception as e:
        raise BadParams(
            f"reasoning-gym's {name} could not generate task {task_id}: {type(e).__name__}: {e}"
        ) from e


def statement(record: Mapping[str, Any]) -> str:
    return str(record["question"])


def prompt(record: Mapping[str, Any]) -> str:
    """What ``reset`` returns: the instruction and the item's question."""
    return f"{SYSTEM}\nQuestion: {statement(record)}\n"


def reference_actions(record: Mapping[str, Any]) -> list[str]:
    answer = record.get("answer")
    if answer is None:
        raise ValueError("this reasoning-gym dataset gives no reference answer to script actions from")
    return [json_call("finish", answer=str(answer))]


def make(name: str, params: Mapping[str, Any], task_id: str, timeout_s: float) -> ReasoningGymEnv:
    return ReasoningGymEnv(name, dict(params), task_id, timeout_s)


class ReasoningGymEnv:
    name = "reasoning_gym"

    def __init__(self, dataset: str, params: dict[str, Any], task_id: str, timeout_s: float = 10.0) -> None:
        self.dataset = dataset
        self.params = params
        self.task_id = task_id
        self.timeout_s = timeout_s
        self.record: dict[str, Any] = {}
        self.result: dict[str, Any] = {"score": 0.0, "answer": None}

    async def _run(self, what: str, fn: Callable[[], T]) -> T:
        """Library code, in a thread under the job's timeout."""
        return await in_thread(f"reasoning-gym's {self.dataset}", what, fn, self.timeout_s)

    async def reset(self) -> str:
        self.record = await self._run(
            f"task {self.task_id}", lambda: task(self.dataset, self.params, self.task_id)
        )
        self.result = {"score": 0.0, "answer": None}
        return prompt(self.record)

    async def step(self, call: ToolCall) -> Observation:
        if call.name.lower() != "finish":
            return unknown_tool(call, TOOLS)
        raw = call.arguments.get("answer", call.arguments.get("input", ""))
        answer = raw if isinstance(raw, str) else json.dumps(raw)
        key = _key(self.params)
        value = await self._run(
            "score_answer", lambda: _dataset(self.dataset, key).score_answer(answer, self.record)
        )
        try:
            score = float(value)
        except (TypeError, ValueError):
            raise LibraryError(f"reasoning-gym's {self.dataset}: score_answer returned {value!r}") from None
        if not math.isfinite(score):
            raise LibraryError(f"reasoning-gym's {self.dataset}: score_answer returned {score}")
        self.result = {"score": score, "correct": score >= 1.0, "answer": answer, "dataset": self.dataset}
        return Observation(f"Answer {answer!r} recorded.", done=True)

    def reference_actions(self) -> list[str]:
        return reference_actions(self.record)

    def verdict(self) -> dict[str, Any]:
        return dict(self.result)

    async def close(self) -> None:
        pass

"""Which environments exist, which task sets feed them, and how a trajectory's environment is made."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from loom.envs import code_env, coin, hotpotqa, math_env, search_env, tasksets
from loom.envs.base import Env
from loom.protocol import TaskSpec
from loom.sandbox import Sandbox
from loom.tokenizer import count_tokens

# Environment -> the task sets it runs (the first is its default).
DATASETS: dict[str, tuple[str, ...]] = {
    "code": ("humaneval", "mbpp"),
    "math": ("gsm8k", "gsm8k-train", "arith", "arith-eval"),
    "search": ("hotpotqa",),
    "coin": ("coin", "coin-eval"),
}
SANDBOXED = frozenset({"code", "math"})


@functools.cache
def _load(name: str, path: str | None) -> Mapping[str, Any]:
    """A task set by id, loaded once: every trajectory's environment looks its task up here."""
    if name == "humaneval":
        return tasksets.humaneval(path)
    if name == "mbpp":
        return tasksets.mbpp(path)
    if name in ("gsm8k", "gsm8k-train"):
        return tasksets.gsm8k(path, "test" if name == "gsm8k" else "train")
    if name in ("arith", "arith-eval"):
        if path is not None:
            raise ValueError(f"task set {name!r} is generated, not read from a file: give no path")
        return tasksets.arith("train" if name == "arith" else "eval")
    if name in ("coin", "coin-eval"):
        if path is not None:
            raise ValueError(f"task set {name!r} is generated, not read from a file: give no path")
        return coin.coin_tasks("train" if name == "coin" else "eval")
    if name == "hotpotqa":
        return {q.id: q for q in hotpotqa.load(path).questions}
    raise KeyError(f"unknown task set {name!r}")


def statement(task: Any) -> str:
    if isinstance(task, tasksets.CodeTask):
        return task.prompt
    if isinstance(task, tasksets.MathTask):
        return task.question
    if isinstance(task, coin.CoinTask):
        return coin.prompt(task)
    return str(task.question)


def env_of_set(name: str) -> str:
    """The built-in environment that runs task set ``name``; KeyError naming the known sets otherwise."""
    for env, sets in DATASETS.items():
        if name in sets:
            return env
    known = sorted(s for sets in DATASETS.values() for s in sets)
    raise KeyError(f"unknown task set {name!r}; the built-in sets are {known}")


def _tasks(env: str, name: str, path: str | None) -> Mapping[str, Any]:
    if name not in DATASETS.get(env, ()):
        raise ValueError(f"environment {env!r} runs {list(DATASETS.get(env, ()))}, not {name!r}")
    return _load(name, path)


def task_ids(env: str, name: str, path: str | None) -> list[str]:
    """The ids of a task set, in file order; ValueError if the environment does not run that set."""
    return list(_tasks(env, name, path))


def task_specs(env: str, name: str, path: str | None, ids: list[str]) -> list[TaskSpec]:
    """Tasks of a set as job tasks: the id, where to find it, and the statement for prompt-only prediction."""
    tasks = _tasks(env, name, path)
    missing = [i for i in ids if i not in tasks]
    if missing:
        raise KeyError(f"unknown task id {missing[0]!r} in {name}")
    out = []
    for i in ids:
        text = statement(tasks[i])
        out.append(
            TaskSpec(
                id=i,
                data={"set": name, "path": path, "prompt": text, "prompt_tokens": count_tokens(text)},
            )
        )
    return out


def task_of(spec: TaskSpec) -> Any:
    return _load(str(spec.data["set"]), spec.data.get("path"))[spec.id]


# A task's scripted actions come from its data alone: no environment is built (no search index, no sandbox).
_SCRIPTS: dict[str, Callable[[Any], list[str]]] = {
    "code": code_env.reference_actions,
    "math": math_env.reference_actions,
    "search": search_env.reference_actions,
    "coin": coin.reference_actions,
}


def reference_actions(env: str, spec: TaskSpec) -> list[str]:
    """The scripted actions for a task; ValueError when its task set has no reference solution."""
    if env not in _SCRIPTS:
        raise ValueError(f"environment {env!r} has no reference solutions to script actions from")
    return _SCRIPTS[env](task_of(spec))


def make(env: str, spec: TaskSpec, sandbox: Sandbox | None, timeout_s: float) -> Env:
    task = task_of(spec)
    if env == "search":
        return search_env.SearchEnv(task, search_env.index(spec.data.get("path")))
    if env == "coin":
        return coin.CoinEnv(task)
    if env not in SANDBOXED:
        raise ValueError(f"unknown environment {env!r}")
    if sandbox is None:
        raise ValueError(f"environment {env!r} needs a sandbox")
    if env == "code":
        return code_env.CodeEnv(task, sandbox, timeout_s)
    return math_env.MathEnv(task, sandbox, timeout_s)

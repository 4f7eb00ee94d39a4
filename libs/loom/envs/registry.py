"""Which environments exist, which task sets feed them, and how a trajectory's environment is made.

An environment name resolves through one table, ``KINDS`` (``resolve``):

- a built-in name (``code``, ``math``, ``search``, ``coin``): an environment of this package, run on its task
  sets; ``replay`` and ``external``: recorded traces, and an agent outside Loom;
- a library's prefix (``reasoning_gym:<dataset>``): an adapter module (``loom.envs.adapters``) serves the
  library's environments; the library is an optional dependency, imported when a job first names it;
- anything else of the form ``module:Class``: a user's environment by import path (``loom.envs.api``).

A library's prefix is reserved: ``reasoning_gym:X`` is never read as an import path. Adding a library is one
entry in ``KINDS`` and one adapter module.

``resolve`` is the one place a name is parsed: what it returns answers everything the system asks of a job's
environment (its loop, its work lane, whether it needs a sandbox, its library and the library's name of it), and
the scheduler, the environment managers and the task expansion all ask it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

from loom.envs import code_env, coin, hotpotqa, math_env, search_env, tasksets
from loom.envs.adapters import Adapter
from loom.envs.base import Env
from loom.protocol import TaskSpec, subjects
from loom.sandbox import Sandbox
from loom.text.tokenizer import count_tokens

# Which per-trajectory loop of the environment manager runs a kind: the built-in environments' (``env``,
# services.envmgr.env_loop), a user environment's (``user``), trace replay, an external agent's, or a verifiers
# environment's own rollout (``verifiers``: services.envmgr.verifiers_loop).
Loop = Literal["env", "user", "replay", "external", "verifiers"]


@dataclass(frozen=True)
class Builtin:
    """An environment of this package: the task sets it runs (the first is its default), how one is made for a
    task, and a task's scripted actions (from its data alone: no environment is built)."""

    sets: tuple[str, ...]
    build: Callable[[Any, TaskSpec, Sandbox | None, float], Env]
    script: Callable[[Any], list[str]]
    sandboxed: bool = False
    loop: Loop = "env"


@dataclass(frozen=True)
class Special:
    """A name that runs no environment of Loom's: ``replay`` (recorded traces) or ``external`` (an agent)."""

    loop: Loop


@dataclass(frozen=True)
class ImportPath:
    """A user's environment class by import path, ``module:Class`` (``loom.envs.api``)."""

    loop: Loop = "user"


@dataclass(frozen=True)
class Library:
    """A library's environments, ``<prefix>:<name>``, served by the adapter module ``adapter``: as
    ``loom.envs.base.Env`` objects (``make``) on the built-in loop, or as ``loom.envs.api.Environment`` classes
    (``environment``) on the user loop, for libraries whose environments take the model's reply as text and
    answer with chat messages. A library whose pins cannot sit beside Loom's runs in a virtualenv of its own:
    its trajectories go to a work ``lane`` of their own, which only managers started from that virtualenv take
    (``loom up`` starts one)."""

    adapter: str
    loop: Loop = "env"
    lane: str = subjects.MAIN_LANE

    def load(self) -> Adapter:
        return cast(Adapter, importlib.import_module(self.adapter))


Kind = Builtin | Special | ImportPath | Library


def _sandbox(env: str, sandbox: Sandbox | None) -> Sandbox:
    if sandbox is None:
        raise ValueError(f"environment {env!r} needs a sandbox")
    return sandbox


# Keys: a built-in name, a library's prefix (ending in ":"), and "module:Class" for every other import path.
KINDS: dict[str, Kind] = {
    "code": Builtin(
        ("humaneval", "mbpp"),
        lambda task, spec, sb, t: code_env.CodeEnv(task, _sandbox("code", sb), t),
        code_env.reference_actions,
        sandboxed=True,
    ),
    "math": Builtin(
        ("gsm8k", "gsm8k-train", "arith", "arith-eval"),
        lambda task, spec, sb, t: math_env.MathEnv(task, _sandbox("math", sb), t),
        math_env.reference_actions,
        sandboxed=True,
    ),
    "search": Builtin(
        ("hotpotqa",),
        lambda task, spec, sb, t: search_env.SearchEnv(task, search_env.index(spec.data.get("path"))),
        search_env.reference_actions,
    ),
    "coin": Builtin(
        ("coin", "coin-eval"), lambda task, spec, sb, t: coin.CoinEnv(task), coin.reference_actions
    ),
    "replay": Special("replay"),
    "external": Special("external"),
    "reasoning_gym:": Library("loom.envs.adapters.reasoning_gym"),
    "skyrl_gym:": Library("loom.envs.adapters.skyrl_gym", loop="user"),
    "gem:": Library("loom.envs.adapters.gem", loop="user", lane="gem"),
    "verifiers:": Library("loom.envs.adapters.verifiers", loop="verifiers"),
    "module:Class": ImportPath(),
}
IMPORT_PATH = "module:Class"

# Environment -> the task sets it runs (the first is its default).
DATASETS: dict[str, tuple[str, ...]] = {n: k.sets for n, k in KINDS.items() if isinstance(k, Builtin)}
# The work lanes: the main one, and each library's of its own (envmgr's LOOM_ENVMGR_LANES names some of them).
LANES = tuple(
    dict.fromkeys([subjects.MAIN_LANE, *(k.lane for k in KINDS.values() if isinstance(k, Library))])
)


class Resolved(NamedTuple):
    kind: Kind
    # What follows a library's prefix (the library's name of the environment), the import path, or "".
    arg: str

    @property
    def loop(self) -> Loop:
        return self.kind.loop

    @property
    def lane(self) -> str:
        """The work lane its trajectories go to (loom.protocol.subjects.traj_work)."""
        return self.kind.lane if isinstance(self.kind, Library) else subjects.MAIN_LANE

    @property
    def sandboxed(self) -> bool:
        """Whether the built-in loop's environment needs a sandbox (a user environment's class says so itself)."""
        return isinstance(self.kind, Builtin) and self.kind.sandboxed

    def library(self) -> tuple[Adapter, str] | None:
        """The adapter and the library's name of the environment (None: no library's); the adapter's module is
        imported here, the library itself not yet."""
        return (self.kind.load(), self.arg) if isinstance(self.kind, Library) else None


def resolve(env: str) -> Resolved:
    """The kind of environment ``env`` names; ValueError for a name that is none."""
    prefix, colon, rest = env.partition(":")
    if not colon:
        kind = KINDS.get(env)
        if kind is None or isinstance(kind, (Library, ImportPath)):
            known = sorted(n for n, k in KINDS.items() if isinstance(k, (Builtin, Special)))
            raise ValueError(f"unknown environment {env!r}: one of {known}, <library>:<name> or module:Class")
        return Resolved(kind, "")
    library = KINDS.get(f"{prefix}:")
    if library is not None:
        if not rest:
            raise ValueError(f"environment {env!r} names no environment of the library")
        return Resolved(library, rest)
    return Resolved(KINDS[IMPORT_PATH], env)


def user_class(env: str, by_path: Callable[[str], Any]) -> Any:
    """The ``loom.envs.api.Environment`` class of a user-loop environment: a library's (its adapter's
    ``environment``), or a user's by import path (``by_path``)."""
    lib = resolve(env).library()
    if lib is None:
        return by_path(env)
    adapter, arg = lib
    return adapter.environment(arg)


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


def task_ids(
    env: str, name: str | None, path: str | None, params: Mapping[str, Any] | None = None
) -> list[str]:
    """The ids of a task set, in order; ValueError if the environment does not run that set. A library
    environment generates its own tasks under ``params`` (the job's ``env_params``): it takes no set name or
    path, and raises the adapters' LibraryMissing, UnknownName or BadParams when it cannot run the job."""
    lib = resolve(env).library()
    if lib is not None:
        if name is not None or path is not None:
            raise ValueError(f"environment {env!r} generates its tasks: name no task set or file")
        adapter, arg = lib
        return adapter.task_ids(arg, adapter.params(arg, params or {}))
    if name is None:
        raise ValueError(f"environment {env!r} needs a task set")
    return list(_tasks(env, name, path))


def task_specs(
    env: str, name: str | None, path: str | None, ids: list[str], params: Mapping[str, Any] | None = None
) -> list[TaskSpec]:
    """Tasks of a set as job tasks: the id, where to find it, and the statement for prompt-only prediction (a
    library environment's task carries the parameters it is generated under, defaults filled in)."""
    lib = resolve(env).library()
    if lib is not None:
        adapter, arg = lib
        used = adapter.params(arg, params or {})
        out = []
        for i in ids:
            text = adapter.statement(adapter.task(arg, used, i))
            data = {
                "set": env,
                "task_id": i,
                "params": used,
                "prompt": text,
                "prompt_tokens": count_tokens(text),
            }
            out.append(TaskSpec(id=i, data=data))
        return out
    if name is None:
        raise ValueError(f"environment {env!r} needs a task set")
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
    """A task's record: a built-in set's, or a library environment's (generated again from its params)."""
    name = str(spec.data["set"])
    lib = resolve(name).library() if ":" in name else None  # a built-in set's name is no environment
    if lib is not None:
        adapter, arg = lib
        return adapter.task(arg, dict(spec.data.get("params") or {}), spec.id)
    return _load(name, spec.data.get("path"))[spec.id]


def reference_actions(env: str, spec: TaskSpec) -> list[str]:
    """The scripted actions for a task; ValueError when its task set has no reference solution."""
    kind = resolve(env).kind
    if isinstance(kind, Library):
        return kind.load().reference_actions(task_of(spec))
    if not isinstance(kind, Builtin):
        raise ValueError(f"environment {env!r} has no reference solutions to script actions from")
    return kind.script(task_of(spec))


def make(env: str, spec: TaskSpec, sandbox: Sandbox | None, timeout_s: float) -> Env:
    """The environment of one trajectory (a library's generates its task when it is reset)."""
    kind, arg = resolve(env)
    if isinstance(kind, Library):
        return kind.load().make(arg, dict(spec.data.get("params") or {}), spec.id, timeout_s)
    if not isinstance(kind, Builtin):
        raise ValueError(f"unknown environment {env!r}")
    return kind.build(task_of(spec), spec, sandbox, timeout_s)

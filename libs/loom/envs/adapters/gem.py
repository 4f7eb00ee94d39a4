"""``gem:<env_id>``: GEM's environments (gem-llm 0.1.0, the suite ROLL trains on), run unchanged, in environment
managers of their own.

Why a virtualenv of its own. gem-llm 0.1.0 pins ``reasoning-gym==0.1.23``, ``msgspec==0.19.0``, ``nltk==3.9.1``
and ``math-verify[antlr4_13_2]``, whose antlr4-python3-runtime 4.13.2 cannot sit beside the 4.9 that verl's
hydra and skyrl-gym's omegaconf pin. So GEM lives in ``.venv-gem`` (``make install`` builds it: Loom without
extras, GEM, and the two packages its math environments import without declaring), and ``loom up`` starts one
environment manager from it that serves only GEM's trajectories: they go to a work lane of their own
(``loom.envs.registry``: its entry's ``lane``) that the main managers never take. Loom's wire structs encode the same
under msgspec 0.19 (tests/unit/test_gem_adapter.py checks it).

Submission. The scheduler runs in the main virtualenv and never imports GEM. Everything a job's tasks need is
computed here without it (a game's tasks are seeds, GSM8K's are Loom's records) except which environments
GEM registers: ``make install`` has the GEM interpreter write that down in the GEM venv
(``python -m loom.envs.adapters.gem``, ``CATALOG``), which the scheduler reads while it describes the GEM
installed there; else it asks the interpreter itself, once per process (``LOOM_GEM_PYTHON``, else the
project's ``.venv-gem``). No interpreter is a 422 (``LibraryMissing``), as is an id GEM does not register or
one Loom cannot give data (``UnknownName``). ``loom up`` starts the GEM manager from that same interpreter,
so what the scheduler accepts that manager can run.

Environments. ``game:*`` (GuessTheNumber, Mastermind, Minesweeper, Sudoku, ...): task ids are seeds, ``"0"`` to
``str(size - 1)``; each trajectory makes ``gem.make(env_id, **kwargs)`` and ``reset(seed)`` (under a lock:
GEM seeds the process-wide RNGs, and concurrent trajectories must each get their seed's game, so that a
group plays one game). Wordle, Hangman and WordSearch need nltk's ``words`` corpus, which Loom does not
download. ``math:GSM8K``: GEM's ``MathEnv`` on Loom's GSM8K records (``loom.envs.tasksets.gsm8k``; task ids
``gsm8k-test/0``, ...), handed to it as a one-row ``datasets.Dataset`` so it never loads its hub copy;
wrapped, as GEM's ``python_tool`` wrapper does (``gem.wrappers.wrapper_factory``), in its ``ToolEnvWrapper``
with its ``PythonCodeTool``, whose code runs in the trajectory's Loom sandbox (``_sandboxed_tool``). Other
ids (hub data sets, search servers, terminals) are refused by name.

Turns, as GEM's chat wrapper (``concat_chat``) lays them out: the first observation is a user message, each
step's observation a user message, or a tool message when GEM's tool ran (Qwen3's template makes that a
``<tool_response>``); GEM's ``info`` prefix and suffix wrap an observation as its wrappers do. Each step's
reward is GEM's; ``terminated or truncated`` ends the trajectory; the trajectory's reward is the sum. The
library's code runs in a thread (``asyncio.to_thread``) under the job's ``tool_timeout_s``; what it raises
fails that trajectory alone (``LibraryError``).

``env_params``: ``kwargs``, GEM's constructor arguments on top of its registration (``gem.make``'s); for
games ``size`` (10 000 seeds unless given); for GSM8K ``split`` (``test`` or ``train``) and ``tool``: the
name of one of GEM's Python-tool wrappers (``python_tool``, the default, with GEM's 0.05 + 0.25 reward per
tool call; ``python_tool_no_int_reward``; ``python_tool_no_int_reward_last_line_error``) or ``null`` for
none.

Scripted jobs: GuessTheNumber guesses by binary search on GEM's higher/lower hints; GSM8K runs the worked
solution's last calculation through the Python tool (when the job has it), then answers ``\\boxed{answer}``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import functools
import importlib
import importlib.metadata
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import msgspec

from loom.envs import tasksets
from loom.envs.adapters import BadParams, LibraryError, LibraryMissing, UnknownName, gsm8k, in_thread
from loom.envs.api import Action, Environment, Message, StepResult
from loom.sandbox import ExecResult, Sandbox, SandboxError

PACKAGE = "gem-llm"
VERSION = "0.1.0"
# No extra of Loom's installs it: GEM's pins cannot share the main virtualenv.
EXTRA = ""
PYTHON_ENV = "LOOM_GEM_PYTHON"
VENV = ".venv-gem"
GSM8K = "math:GSM8K"
SPLITS = ("test", "train")
DEFAULT_SIZE = 10_000
# As many tasks as a job may take from a data set (DatasetRef.limit).
MAX_SIZE = 100_000
DEFAULT_TOOL = "python_tool"
# What Loom gives MathEnv itself; GEM's other constructor arguments may come in ``kwargs``.
RESERVED = {"dataset", "dataset_name", "split", "question_key", "answer_key", "eval"}
# The first run of the GEM interpreter compiles what it imports (the venv is installed without bytecode).
PROBE_TIMEOUT_S = 180.0
# What GEM registers, kept in the GEM venv's root (``keep_catalog``) so that the scheduler reads it in
# milliseconds instead of importing GEM in a child process for seconds while its event loop waits.
CATALOG = "loom-gem-catalog.json"
_HINT = re.compile(r"you guessed (\d+), and the target number is (higher|lower) than")
# GSM8K's solutions annotate each calculation as <<expression=result>>.
_CALC = re.compile(r"<<([^=<>]+)=([^<>]*)>>")
# GEM seeds Python's and numpy's process-wide generators in ``reset(seed)``: one make-and-reset at a time.
_SEEDING = threading.Lock()
T = TypeVar("T")


def default_python() -> str | None:
    """The GEM interpreter: ``LOOM_GEM_PYTHON`` (empty: none), else the project's ``.venv-gem`` if built."""
    given = os.environ.get(PYTHON_ENV)
    if given is not None:
        return given or None
    venv = Path(__file__).resolve().parents[4] / VENV / "bin" / "python"
    return str(venv) if venv.exists() else None


def here() -> bool:
    """Whether GEM is installed in this process's environment (the GEM environment manager's)."""
    try:
        importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _library() -> Any:
    try:
        return importlib.import_module("gem")
    except ImportError as e:
        raise LibraryMissing(
            f"gem environments need the {PACKAGE} package, which runs in a virtualenv of its own "
            f"(`make install` builds {VENV}): {e}"
        ) from e


def describe() -> dict[str, Any]:
    """What GEM registers, from the library itself: its version, every environment id with its entry point,
    and the wrappers of GEM's factory that add its Python tool."""
    _library()
    registry = importlib.import_module("gem.envs.registration").ENV_REGISTRY
    factory = importlib.import_module("gem.wrappers.wrapper_factory").WRAPPER_FACTORY
    python_tool = importlib.import_module("gem.tools.python_code_tool").PythonCodeTool
    tools = [
        name
        for name, w in factory.items()
        if isinstance(w, functools.partial)
        and any(isinstance(t, python_tool) for t in w.keywords.get("tools", ()))
    ]
    envs = {
        i: s.entry_point if isinstance(s.entry_point, str) else repr(s.entry_point)
        for i, s in registry.items()
    }
    return {"version": importlib.metadata.version(PACKAGE), "envs": envs, "python_tools": tools}


def _cached(python: str) -> dict[str, Any] | None:
    """The registry the GEM venv keeps beside itself (``CATALOG``, written when it was built or first asked),
    while the GEM it describes is the one installed there; else None."""
    venv = Path(python).parent.parent
    try:
        found: dict[str, Any] = json.loads((venv / CATALOG).read_text())
    except (OSError, ValueError):
        return None
    installed = {d.name for d in venv.glob("lib/python*/site-packages/gem_llm-*.dist-info")}
    return found if installed == {f"gem_llm-{found.get('version')}.dist-info"} else None


@functools.cache
def catalog() -> dict[str, Any]:
    """``describe()``: in this process where GEM is installed; else what the GEM venv keeps beside itself;
    else asked of the GEM interpreter, once per process (seconds: it imports GEM)."""
    if here():
        return describe()
    python = default_python()
    if python is None or not Path(python).exists():
        where = f"{PYTHON_ENV}={python}" if python else f"no {VENV} and no {PYTHON_ENV}"
        raise LibraryMissing(
            f"gem environments run in a virtualenv of their own with {PACKAGE}=={VERSION} ({where}): "
            f"`make install` builds {VENV}, and `loom up` then starts an environment manager from it"
        )
    kept = _cached(python)
    if kept is not None:
        return kept
    cmd = [python, "-W", "ignore", "-m", __name__]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LibraryMissing(f"the GEM interpreter {python} did not answer: {e}") from e
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        raise LibraryMissing(
            f"the GEM interpreter {python} could not list GEM's environments: {' | '.join(tail)}"
        )
    try:
        found: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError) as e:
        raise LibraryMissing(f"the GEM interpreter {python} answered {out.stdout[-200:]!r}") from e
    return found


def keep_catalog() -> dict[str, Any]:
    """(In the GEM venv.) ``describe()``, kept beside the venv for the scheduler to read (where writable)."""
    found = describe()
    path = Path(sys.prefix) / CATALOG
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(found))
        tmp.replace(path)
    except OSError:
        pass  # a read-only venv: the scheduler asks the interpreter instead
    return found


def names() -> list[str]:
    """The environments GEM registers (those Loom runs: ``game:*`` and ``math:GSM8K``)."""
    return sorted(catalog()["envs"])


def kind(name: str) -> str:
    """``game`` or ``gsm8k``; UnknownName for an id GEM does not register or Loom cannot give data."""
    envs: dict[str, str] = catalog()["envs"]
    if name not in envs:
        close = difflib.get_close_matches(name, list(envs), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        games = sorted({i.split(":", 1)[1].split("-", 1)[0] for i in envs if i.startswith("game:")})
        raise UnknownName(
            f"GEM registers no environment {name!r}{hint}; Loom runs its games, game:<game>-v0-<easy|hard|random> "
            f"for {', '.join(games)}, and {GSM8K}"
        )
    if name == GSM8K:
        return "gsm8k"
    if name.startswith("game:") and envs[name].startswith("gem.envs.game_env."):
        return "game"
    if name.startswith("rg:"):
        raise UnknownName(f"GEM's {name} is reasoning-gym's: run it as reasoning_gym:{name[3:]}")
    raise UnknownName(
        f"GEM's {name} ({envs[name]}) needs data or services Loom does not ship (a hub data set, a search "
        f"server, a terminal); Loom runs GEM's games and {GSM8K}, on its shipped GSM8K data"
    )


def _whole(given: Mapping[str, Any], key: str, default: int, high: int) -> int:
    value = given.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise BadParams(f"{key} must be a whole number from 1 to {high}, not {value!r}")
    return value


def params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    k = kind(name)
    allowed = {"kwargs", "size"} if k == "game" else {"kwargs", "split", "tool"}
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise BadParams(f"GEM's {name} takes env_params {sorted(allowed)}, not {unknown}")
    kwargs = given.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise BadParams(
            f"kwargs (GEM's constructor arguments) must be an object, not {type(kwargs).__name__}"
        )
    out: dict[str, Any] = {"kwargs": kwargs}
    if k == "game":
        out["size"] = _whole(given, "size", DEFAULT_SIZE, MAX_SIZE)
        return out
    taken = sorted(set(kwargs) & RESERVED)
    if taken:
        raise BadParams(f"Loom gives GEM's MathEnv {taken} itself (its GSM8K data): leave them out of kwargs")
    if kwargs.get("use_mp", True) is not True:
        raise BadParams(
            "use_mp must stay true: Loom steps GEM in a thread, where its signal timeout cannot run"
        )
    out["split"] = given.get("split", "test")
    if out["split"] not in SPLITS:
        raise BadParams(f"split must be one of {list(SPLITS)}, not {out['split']!r}")
    tool = given.get("tool", DEFAULT_TOOL)
    tools = list(catalog()["python_tools"])
    if tool is not None and tool not in tools:
        raise BadParams(f"tool must be one of GEM's Python-tool wrappers {tools} or null, not {tool!r}")
    out["tool"] = tool
    return out


def _gsm8k(split: str) -> dict[str, tasksets.MathTask]:
    return gsm8k(split, f"GEM's {GSM8K} reads")


def task_ids(name: str, params: Mapping[str, Any]) -> list[str]:
    if kind(name) == "game":
        return [str(i) for i in range(int(params.get("size", DEFAULT_SIZE)))]
    return list(_gsm8k(str(params.get("split", "test"))))


def task(name: str, params: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    if kind(name) == "game":
        size = int(params.get("size", DEFAULT_SIZE))
        if not task_id.isdigit() or int(task_id) >= size:
            raise KeyError(f"GEM's {name} has seeds 0 to {size - 1} as its task ids, not {task_id!r}")
        return {"kind": "game", "env_id": name, "seed": int(task_id)}
    tasks = _gsm8k(str(params.get("split", "test")))
    if task_id not in tasks:
        ids = list(tasks)
        raise KeyError(f"GEM's {name} has no task {task_id!r} (ids {ids[0]} to {ids[-1]})")
    t = tasks[task_id]
    return {
        "kind": "gsm8k",
        "env_id": name,
        "task_id": t.id,
        "question": t.question,
        "solution": t.solution,
        "answer": t.answer,
        "tool": params.get("tool", DEFAULT_TOOL),
    }


# ``task`` by another name, for ``reset``, whose parameter (the API's ``task``) shadows it.
task_of = task


def statement(record: Mapping[str, Any]) -> str:
    """The task as prompt-only prediction sees it: GSM8K's question; for a game (whose text GEM makes at
    reset, out of the scheduler's reach) its id and seed."""
    if record["kind"] == "game":
        return f"GEM's {record['env_id']}, seed {record['seed']}: reply with a move in \\boxed{{}}."
    return str(record["question"])


def _guesses(env_id: str) -> bool:
    return str(catalog()["envs"].get(env_id, "")).endswith(":GuessTheNumberEnv")


def _calculation(record: Mapping[str, Any]) -> str:
    calcs = _CALC.findall(str(record["solution"]))
    return calcs[-1][0].strip() if calcs else str(record["answer"])


def reference_actions(record: Mapping[str, Any]) -> list[str]:
    """What a scripted policy replies. A game's replies depend on its hints: for GuessTheNumber this names the
    policy (binary search, ``reference_action`` at each turn); other games have none (ValueError)."""
    if record["kind"] == "game":
        if not _guesses(str(record["env_id"])):
            raise ValueError(f"Loom has no scripted policy for GEM's {record['env_id']}")
        return ["\\boxed{the middle of what GEM's higher/lower hints leave}"]
    answer = f"The answer is \\boxed{{{record['answer']}}}."
    if record.get("tool") is None:
        return [answer]
    return [f"Let me compute it.\n<python>\nprint({_calculation(record)})\n</python>", answer]


@functools.cache
def environment(name: str) -> type[GemEnvironment]:
    """The ``loom.envs.api.Environment`` class of GEM's ``name`` (one per name, made once). Called in a thread
    of the GEM manager (untimed): GEM and the environment's modules are imported here, not in a reset that
    runs under the job's timeout."""
    k = kind(name)
    _library()
    if k == "gsm8k":
        for module in ("gem.envs.math_env", "gem.wrappers.wrapper_factory", "datasets"):
            importlib.import_module(module)
        _grading_processes()
    base: type[GemEnvironment] = GemMath if k == "gsm8k" else GemGame
    return cast(type[GemEnvironment], type("Gem_" + re.sub(r"\W", "_", name), (base,), {"env_id": name}))


def _grading_processes() -> None:
    """GEM's MathEnv grades in a ``multiprocessing.Pool`` of its own, one per env. Forked from the manager
    (Linux's default), a worker would inherit the asyncio loop's signal wakeup fd, and the SIGTERM a pool sends
    its worker when it is collected would reach the manager's loop and stop the manager; a fork of a
    many-threaded process may also inherit a lock held mid-way. So the GEM manager's workers come from a
    forkserver: started once, here (not in a timed reset), single-threaded, with GEM's grader preloaded so
    each worker is a fork that imports nothing."""
    if multiprocessing.get_start_method(allow_none=True) != "forkserver":
        multiprocessing.set_start_method("forkserver", force=True)
        multiprocessing.set_forkserver_preload(["gem.envs.math_env"])
    multiprocessing.forkserver.ensure_running()


def _plain(value: Any) -> Any:
    """GEM's info as plain data (numpy scalars as numbers, anything else unknown as text)."""
    return msgspec.to_builtins(value, enc_hook=lambda v: v.item() if hasattr(v, "item") else str(v))


def _wrapped(obs: Any, info: Mapping[str, Any]) -> str:
    """An observation with the prefix and suffix GEM's ``info`` gives, as GEM's observation wrappers add them."""
    text = str(obs)
    if "suffix" in info:
        text = (text if not text or text.endswith("\n") else text + "\n") + str(info["suffix"])
    if "prefix" in info:
        text = str(info["prefix"]) + text
    return text


class GemEnvironment(Environment):
    """One trajectory of GEM's ``env_id``: the library's env (``env``), made and reset in a thread."""

    env_id: ClassVar[str] = ""

    def __init__(self, sandbox: Sandbox | None = None, **params: Any) -> None:
        super().__init__(sandbox, **params)
        self.env: Any = None
        self.record: dict[str, Any] = {}
        self.used: dict[str, Any] = {}
        self.replies = 0

    async def _run(self, what: str, fn: Callable[[], T]) -> T:
        """Library code, in a thread: the user loop's timeout then applies."""
        return await in_thread(f"GEM's {self.env_id}", what, fn, passthrough=(SandboxError,))

    def _make(self) -> tuple[Any, dict[str, Any]]:
        """(In a thread.) Make the library's env for ``record`` and reset it: (first observation, info)."""
        raise NotImplementedError

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if "task_id" not in task:
            raise LibraryError(f"GEM's {self.env_id}: the task carries no task_id")
        # The parameters the scheduler filled in; a task without them (made by hand) gets the job's.
        self.used = dict(task.get("params") or params(self.env_id, self.params))
        task_id = str(task["task_id"])
        self.record = await self._run(f"task {task_id}", lambda: task_of(self.env_id, self.used, task_id))
        self.replies = 0
        obs, info = await self._run("reset", self._make)
        return [{"role": "user", "content": _wrapped(obs, info)}]

    async def step(self, action: Action) -> StepResult:
        if self.env is None:
            raise LibraryError(f"GEM's {self.env_id}: step before reset")
        self.replies += 1
        out = await self._run("step", lambda: self.env.step(action.text))
        try:
            obs, reward, terminated, truncated, info = out
            info = dict(info or {})
        except (TypeError, ValueError) as e:
            raise LibraryError(f"GEM's {self.env_id}: step returned {out!r}, not (obs, reward, ...)") from e
        self.observed(str(obs))
        # GEM's tool wrapper marks a step its tool ran by the tool's type; its chat wrapper makes that a tool turn.
        role = "tool" if "tool_type" in info else "user"
        done = bool(terminated or truncated)
        # The last observation reaches no model: it is kept as GEM said it, without the prompt to go on.
        text = str(obs) if done else _wrapped(obs, info)
        return StepResult(
            observation=[{"role": role, "content": text}],
            done=done,
            reward=float(reward),
            info={**_plain(info), "terminated": bool(terminated), "truncated": bool(truncated)},
        )

    def observed(self, obs: str) -> None:
        """What a scripted policy learns from an observation (nothing, unless it reads hints)."""

    async def close(self) -> None:
        env, self.env = self.env, None
        close = getattr(env, "close", None)
        if close is not None:
            await self._run("close", close)


class GemGame(GemEnvironment):
    """A game of GEM's (``game:*``), its task id the seed it is reset with."""

    def __init__(self, sandbox: Sandbox | None = None, **params: Any) -> None:
        super().__init__(sandbox, **params)
        # GuessTheNumber's scripted policy: the range GEM's hints still leave.
        self.low = self.high = 0

    def _make(self) -> tuple[Any, dict[str, Any]]:
        lib = _library()
        with _SEEDING:
            self.env = lib.make(self.env_id, **dict(self.used.get("kwargs") or {}))
            obs, info = self.env.reset(seed=int(self.record["seed"]))
        game = self.env.unwrapped
        self.low, self.high = (
            int(getattr(game, "min_number", 0) or 0),
            int(getattr(game, "max_number", 0) or 0),
        )
        return obs, dict(info or {})

    def observed(self, obs: str) -> None:
        m = _HINT.search(obs)
        if m is not None:
            guess = int(m.group(1))
            if m.group(2) == "higher":
                self.low = max(self.low, guess + 1)
            else:
                self.high = min(self.high, guess - 1)

    def reference_action(self) -> str:
        """A binary search on GEM's hints (GuessTheNumber): the middle of the range they leave."""
        if not _guesses(self.env_id):
            raise LibraryError(f"Loom has no scripted policy for GEM's {self.env_id}")
        if self.env is None:
            raise LibraryError(f"GEM's {self.env_id}: no game yet to script a reply for")
        return f"My guess is \\boxed{{{(self.low + self.high) // 2}}}."


class GemMath(GemEnvironment):
    """GEM's ``MathEnv`` on one GSM8K record of Loom's, wrapped in GEM's Python-tool wrapper (when the job
    has one) with the tool's code run in this trajectory's sandbox."""

    needs_sandbox: ClassVar[bool] = True

    def __init__(self, sandbox: Sandbox | None = None, **params: Any) -> None:
        super().__init__(sandbox, **params)
        self.loop: asyncio.AbstractEventLoop | None = None
        # The sandbox command the tool (in the library's thread) waits for, to cancel with the step.
        self.pending: concurrent.futures.Future[ExecResult] | None = None

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        self.loop = asyncio.get_running_loop()
        return await super().reset(task)

    async def step(self, action: Action) -> StepResult:
        try:
            return await super().step(action)
        except asyncio.CancelledError:
            pending = self.pending
            if pending is not None:
                pending.cancel()  # the sandbox command stops; the thread waiting on it then ends
            raise

    def _make(self) -> tuple[Any, dict[str, Any]]:
        lib = _library()
        dataset = importlib.import_module("datasets").Dataset
        data = dataset.from_list([{"problem": self.record["question"], "answer": self.record["answer"]}])
        # One row and no shuffle: reset() gives this task; GEM never loads its hub copy of the data.
        self.env = lib.make(self.env_id, dataset=data, eval=True, **dict(self.used.get("kwargs") or {}))
        # GEM gives its grading one second, counted from the answer: on a busy host a worker just started may
        # not be up by then, and a right answer would score 0. So its worker answers once before the episode.
        pool = getattr(self.env, "mp_pool", None)
        if pool is not None:
            pool.apply(abs, (0,))
        tool = self.used.get("tool")
        if tool is not None:
            factory = importlib.import_module("gem.wrappers.wrapper_factory").WRAPPER_FACTORY[tool]
            options = dict(factory.keywords)
            tools = [_sandboxed_tool()(t, self.run_code) for t in options.pop("tools")]
            self.env = factory.func(self.env, tools=tools, **options)
        obs, info = self.env.reset()
        return obs, dict(info or {})

    def run_code(self, code: str, timeout_s: float) -> ExecResult:
        """(In the library's thread.) ``code`` run with ``python3`` in the trajectory's sandbox, on the loop."""
        if self.sandbox is None or self.loop is None:
            raise LibraryError(f"GEM's {self.env_id}: its Python tool has no sandbox")
        self.pending = asyncio.run_coroutine_threadsafe(self._exec(self.sandbox, code, timeout_s), self.loop)
        try:
            return self.pending.result()
        finally:
            self.pending = None

    @staticmethod
    async def _exec(sandbox: Sandbox, code: str, timeout_s: float) -> ExecResult:
        await sandbox.write_files({"gem_tool.py": code})
        return await sandbox.exec(["python3", "gem_tool.py"], timeout_s=timeout_s)

    def reference_action(self) -> str:
        """The worked solution's last calculation through the tool (when the job has it), then the answer."""
        script = reference_actions(self.record)
        return script[min(self.replies, len(script) - 1)]


@functools.cache
def _sandboxed_tool() -> Any:
    """GEM's ``PythonCodeTool`` with its code run in Loom's sandbox: a subclass (made once GEM is importable)
    that keeps GEM's parsing of the reply, its instruction and its observation's format, and replaces only
    ``gem.utils.sandbox.run_python`` (GEM's local subprocess). Like GEM's bwrap mode it runs the code as
    given: the container isolates it, so GEM's text filter of dangerous imports (its no-sandbox mode) is not
    applied."""
    base = importlib.import_module("gem.tools.python_code_tool").PythonCodeTool
    base_imports = importlib.import_module("gem.utils.constants").BASE_IMPORTS

    class SandboxedPythonTool(base):  # type: ignore[misc, valid-type]
        def __init__(self, configured: Any, run: Callable[[str, float], ExecResult]) -> None:
            super().__init__(
                timeout=configured.timeout,
                sandbox_type="loom",
                keep_error_last_line=configured.keep_error_last_line,
            )
            self.run = run

        def run_python(self, code: str) -> tuple[bool, str, str]:
            """``gem.utils.sandbox.run_python``'s contract: (success, stdout, stderr), a second run with GEM's
            usual imports when a name is missing, and GEM's words for a timeout."""

            def once(source: str) -> tuple[bool, str, str]:
                r = self.run(source, float(self.timeout))
                if r.timed_out:
                    raise TimeoutError
                return r.exit_code == 0, r.stdout, r.stderr.strip()

            try:
                ok, out, err = once(code)
                if not ok and "is not defined" in err:
                    ok, out, err = once(base_imports + "\n" + code)
            except TimeoutError:
                return False, "", f"\nExecution timed out after {self.timeout} seconds."
            return ok, out, err

        def execute_action(self, action: str) -> tuple[bool, bool, str, str]:
            # GEM's PythonCodeTool.execute_action, with run_python above in place of GEM's subprocess.
            parsed_code, parsed_action, is_valid = self._parse_action(action)
            if not is_valid:
                return is_valid, True, "", parsed_action
            success, stdout, stderr = self.run_python(parsed_code)
            if stderr and self.keep_error_last_line:
                stderr = stderr.split("\n")[-1]
            result = f"{stdout}\n{stderr}" if stderr else stdout
            return (
                is_valid,
                not success,
                "Code execution result: " + result.lstrip(" \n") + "\n",
                parsed_action,
            )

    return SandboxedPythonTool


if __name__ == "__main__":
    # The scheduler's question to the GEM interpreter (``catalog``), and `make install`'s after building the venv:
    # what GEM registers, as one JSON line, kept beside the venv too.
    sys.stdout.write(json.dumps(keep_catalog()) + "\n")

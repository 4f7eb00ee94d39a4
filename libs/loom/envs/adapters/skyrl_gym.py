"""``skyrl_gym:<env_id>``: SkyRL-Gym's text environments, run unchanged (``pip install 'loom[skyrl_gym]'``).

A SkyRL-Gym environment (``BaseTextEnv``) takes the model's reply as text and answers with chat messages, so
it runs on the user loop (``services.envmgr.user_loop``): the environment's first messages and each step's
observations go through Qwen3's chat template as every user environment's do, and the engine's output ids
are kept as produced. The environment is made per trajectory as SkyRL's own generator makes it,
``skyrl_gym.make(env_id, env_config=..., extras=<the task's row>)``, then ``init(prompt)`` and ``step(text)``
until it says ``done``; each step's reward is SkyRL's (turn-level for ``gsm8k_multi_turn``) and the
trajectory's reward is their sum, which is what SkyRL trains on as the return.

Tasks. SkyRL-Gym ships environments, not data: its trainer reads parquet rows that its example scripts
build. ``gsm8k`` and ``gsm8k_multi_turn`` get those rows from the GSM8K data Loom already ships
(``loom.envs.tasksets.gsm8k``), built exactly as SkyRL's preprocessing builds them (``_row``): the question
plus SkyRL's instruction as one user message, and ``reward_spec = {"method": "rule", "ground_truth": <the
number after "####">}``, which the environment scores the reply's ``#### <answer>`` against. Task ids are
Loom's GSM8K ids (``gsm8k-test/0``). The other environments the library registers need data or services
Loom does not have (AIME problems, SQL databases, a search server, LiveCodeBench) and are refused by name.

``env_params``: ``split`` (``test``, the default, or ``train``); ``max_turns`` for ``gsm8k_multi_turn``
(SkyRL's default, 5; set the job's own ``max_turns`` at least as high, or Loom ends the trajectory first);
``env_config``, SkyRL's per-environment config (``skyrl_gym.<env_id>`` in its trainer config; the GSM8K
environments read none of it).

Scripted jobs: the first reply is the task's worked GSM8K solution, which ends ``#### <answer>`` and scores
1.0; any later one (the environment asked again) is the bare ``#### <answer>`` it asks for.

SkyRL's ``postprocessed_action`` (a reply the environment cut short) is recorded in the step's info, not
applied: Loom keeps the ids the engine produced. The library's code runs in a thread (``asyncio.to_thread``)
so that the user loop's ``tool_timeout_s`` applies; what it raises fails that trajectory alone
(``LibraryError``, not retried: it would fail again).
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from loom.envs import tasksets
from loom.envs.adapters import BadParams, LibraryError, LibraryMissing, UnknownName, gsm8k, in_thread
from loom.envs.api import Action, Environment, Message, StepResult
from loom.sandbox import Sandbox

PACKAGE = "skyrl-gym"
EXTRA = "skyrl_gym"
# SkyRL's preprocessing scripts (examples/gsm8k/gsm8k_dataset.py, and the turn-level-rewards example's
# gsm8k_multi_turn_dataset.py): the instruction appended to each question, and the row's data_source.
INSTRUCTIONS = {
    "gsm8k": 'Let\'s think step by step and output the final answer after "####".',
    "gsm8k_multi_turn": 'Let\'s think step by step and output a tentative numeric answer after "####".',
}
DATA_SOURCE = "openai/gsm8k"
SPLITS = ("test", "train")
# SkyRL's default for gsm8k_multi_turn (its dataset script's --max_turns), and a bound on what a job may ask.
MAX_TURNS = 5
MAX_TURNS_LIMIT = 1000
# The registered environments Loom cannot give tasks, and what they would need.
NEEDS = {
    "aime": "AIME problems",
    "text2sql": "SQL databases and their questions",
    "search": "a retrieval server and its questions",
    "searchcode": "a retrieval server and coding problems",
    "lcb": "LiveCodeBench problems and their tests",
}
# What SkyRL's preprocessing takes as the ground truth: the first number after "####", commas dropped.
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
T = TypeVar("T")


def _library() -> Any:
    try:
        return importlib.import_module("skyrl_gym")
    except ImportError as e:
        raise LibraryMissing(
            f"skyrl_gym environments need the {PACKAGE} package: pip install 'loom[{EXTRA}]' ({e})"
        ) from e


def names() -> list[str]:
    """The environments SkyRL-Gym registers (those Loom runs are the keys of ``INSTRUCTIONS``)."""
    return sorted(_library().registry)


def _check_name(name: str) -> None:
    known = names()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise UnknownName(f"skyrl-gym has no environment {name!r}{hint}; it registers {', '.join(known)}")
    if name not in INSTRUCTIONS:
        need = NEEDS.get(name, "tasks of its own")
        raise UnknownName(
            f"skyrl-gym's {name} needs {need}, which Loom does not ship; Loom runs "
            f"{' and '.join(sorted(INSTRUCTIONS))} on its GSM8K data"
        )


def params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    _check_name(name)
    allowed = {"split", "env_config"} | ({"max_turns"} if name == "gsm8k_multi_turn" else set())
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise BadParams(f"skyrl-gym's {name} takes env_params {sorted(allowed)}, not {unknown}")
    out: dict[str, Any] = {"split": given.get("split", "test")}
    if out["split"] not in SPLITS:
        raise BadParams(f"split must be one of {list(SPLITS)}, not {out['split']!r}")
    if name == "gsm8k_multi_turn":
        turns = given.get("max_turns", MAX_TURNS)
        if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= MAX_TURNS_LIMIT:
            raise BadParams(f"max_turns must be a whole number from 1 to {MAX_TURNS_LIMIT}, not {turns!r}")
        out["max_turns"] = turns
    if "env_config" in given:
        if not isinstance(given["env_config"], dict):
            raise BadParams(f"env_config must be an object, not {type(given['env_config']).__name__}")
        out["env_config"] = given["env_config"]
    return out


def _tasks(split: str) -> dict[str, tasksets.MathTask]:
    return gsm8k(split, "skyrl-gym's GSM8K environments read")


def task_ids(name: str, params: Mapping[str, Any]) -> list[str]:
    return list(_tasks(str(params.get("split", "test"))))


def ground_truth(solution: str) -> str:
    """The reward spec's ground truth of a GSM8K solution, as SkyRL's preprocessing extracts it."""
    m = _ANSWER.search(solution)
    if m is None:
        raise ValueError("the solution has no '#### <number>' line")
    return m.group(0).split("#### ")[1].replace(",", "")


def _row(name: str, params: Mapping[str, Any], t: tasksets.MathTask) -> dict[str, Any]:
    """A task as SkyRL's dataset row: ``prompt`` and ``env_class``, and the rest are the env's extras."""
    split = str(params.get("split", "test"))
    extra: dict[str, Any] = {
        "split": split,
        "index": int(t.id.rsplit("/", 1)[1]),
        "answer": t.solution,
        "question": t.question,
    }
    if "max_turns" in params:
        extra = {"max_turns": params["max_turns"], **extra}
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{t.question} {INSTRUCTIONS[name]}"}],
        "env_class": name,
        "reward_spec": {"method": "rule", "ground_truth": ground_truth(t.solution)},
        "extra_info": extra,
    }


def task(name: str, params: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    _check_name(name)
    tasks = _tasks(str(params.get("split", "test")))
    if task_id not in tasks:
        ids = list(tasks)
        raise KeyError(f"skyrl-gym's {name} has no task {task_id!r} (ids {ids[0]} to {ids[-1]})")
    return _row(name, params, tasks[task_id])


# ``task`` by another name, for ``reset``, whose parameter (the API's ``task``) shadows it.
task_of = task


def statement(record: Mapping[str, Any]) -> str:
    return str(record["prompt"][-1]["content"])


def reference_actions(record: Mapping[str, Any]) -> list[str]:
    return [str(record["extra_info"]["answer"])]


def extras(record: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """What SkyRL's generator passes as ``extras``: the row without its prompt and env class, and the
    trainer's ``max_turns`` on top (which gsm8k_multi_turn reads before the row's)."""
    out = {k: copy.deepcopy(v) for k, v in record.items() if k not in ("prompt", "env_class")}
    if "max_turns" in params:
        out["max_turns"] = params["max_turns"]
    return out


def _env_config(params: Mapping[str, Any]) -> Any:
    # SkyRL's trainer hands each environment its section of an OmegaConf config (attribute access).
    config = dict(params.get("env_config") or {})
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return config
    return OmegaConf.create(config)


@functools.cache
def environment(name: str) -> type[SkyRLGymEnvironment]:
    """The ``loom.envs.api.Environment`` class of SkyRL-Gym's ``name`` (one per name, made once)."""
    _check_name(name)
    return type(f"SkyRLGym_{name}", (SkyRLGymEnvironment,), {"env_id": name})


class SkyRLGymEnvironment(Environment):
    """One trajectory of a SkyRL-Gym environment (``env_id``): the row of its task, the library's env made
    from it, and what the environment said so far (for scripted replies)."""

    env_id: ClassVar[str] = ""

    def __init__(self, sandbox: Sandbox | None = None, **params: Any) -> None:
        super().__init__(sandbox, **params)
        self.env: Any = None
        self.record: dict[str, Any] = {}
        self.replies = 0

    async def _run(self, what: str, fn: Callable[[], T]) -> T:
        """Library code, in a thread: the user loop's timeout then applies."""
        return await in_thread(f"skyrl-gym's {self.env_id}", what, fn)

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        if "task_id" not in task:
            raise LibraryError(f"skyrl-gym's {self.env_id}: the task carries no task_id")
        # The parameters the scheduler filled in; a task without them (made by hand) gets the job's.
        used = task.get("params") or params(self.env_id, self.params)
        task_id = str(task["task_id"])
        self.record = await self._run(f"task {task_id}", lambda: task_of(self.env_id, used, task_id))
        lib = _library()
        self.env = await self._run(
            "make",
            lambda: lib.make(self.env_id, env_config=_env_config(used), extras=extras(self.record, used)),
        )
        self.replies = 0
        prompt = copy.deepcopy(self.record["prompt"])
        messages, _ = await self._run("init", lambda: self.env.init(prompt))
        return list(messages)

    async def step(self, action: Action) -> StepResult:
        if self.env is None:
            raise LibraryError(f"skyrl-gym's {self.env_id}: step before reset")
        self.replies += 1
        out = await self._run("step", lambda: self.env.step(action.text))
        try:
            observations = list(out.get("observations") or [])
            done = bool(out["done"])
            reward = out.get("reward")
            info: dict[str, Any] = {"metadata": dict(out.get("metadata") or {})}
        except (AttributeError, KeyError, TypeError) as e:
            raise LibraryError(
                f"skyrl-gym's {self.env_id}: step returned {out!r}, not a BaseTextEnvStepOutput"
            ) from e
        if out.get("postprocessed_action") is not None:
            info["postprocessed_action"] = out["postprocessed_action"]
        if done:
            env = self.env
            info["metrics"] = await self._run("get_metrics", lambda: dict(env.get_metrics()))
        return StepResult(observation=observations, done=done, reward=reward, info=info)

    def reference_action(self) -> str:
        """The reply a scripted policy gives now: the worked solution first, then the bare answer."""
        if not self.record:
            raise LibraryError(f"skyrl-gym's {self.env_id}: no task yet to script a reply for")
        if self.replies == 0:
            return reference_actions(self.record)[0]
        return f"#### {self.record['reward_spec']['ground_truth']}"

    async def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            await self._run("close", env.close)

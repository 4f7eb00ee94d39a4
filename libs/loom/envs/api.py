"""The interface of an environment a user brings, by import path: ``"env": "my_pkg.envs:Sokoban"``.

An environment is a class; the environment manager makes one instance per trajectory (per attempt: a reset
that fails transiently is retried on a fresh instance) and drives it::

    class Sokoban(Environment):
        tools = [{"type": "function", "function": {"name": "move", "parameters": {...}}}]
        needs_sandbox = False          # True: __init__ receives a Docker sandbox of its own

        def __init__(self, sandbox=None, **params):   # params: the job's env_params
            ...

        async def reset(self, task: dict) -> list[dict] | str:
            # the first messages the model sees (OpenAI chat messages; a string is one user message)

        async def step(self, action: Action) -> StepResult:
            # action.tool_calls are the reply's calls, parsed from Qwen's format; action.text is all of it
            return StepResult(observation="...", done=False, reward=None, info={})

        async def close(self) -> None: ...

        def reference_action(self) -> str:      # optional: the reply a scripted job gives now
            ...

``task`` is the job's task data (an inline task's ``data``, or one record of a JSONL dataset). The prompt is
Qwen3's chat template over the messages and ``tools``; each observation follows the model's reply as tool
results (one ``tool`` message per call when the reply made calls, else a user turn), or as the messages
given. A job with ``scripted: true`` replies at each turn with ``reference_action()`` (sync or async; it may
read what the environment has said so far), which the engine scores as its own output. The trajectory's reward is the sum of the rewards its steps returned, unless the job names a reward
function. ``reset`` and ``step`` each run under the job's ``tool_timeout_s``.

Failures end only their own trajectory, with the reason: raise ``EnvError`` for a transient failure that may
be retried (a step is retried on the same instance, so raise it only where that is safe); any other
exception, or a timeout, fails the trajectory at once. ``reset`` and ``step`` run on the environment
manager's event loop beside every other trajectory: put blocking work in ``asyncio.to_thread`` (a timeout
cannot interrupt code that never awaits). Rewards are numbers; ``info`` is plain data (it is stored).
"""

from __future__ import annotations

from typing import Any, ClassVar

from msgspec import Struct

from loom.envs.base import EnvError
from loom.sandbox import Sandbox
from loom.text.chat import Message, ToolCall

__all__ = ["Action", "EnvError", "Environment", "Message", "StepResult", "ToolCall"]


class Action(Struct, frozen=True):
    """The model's reply: all its text, the content before any tool call, and the calls it made."""

    text: str
    content: str
    tool_calls: list[ToolCall]


class StepResult(Struct):
    observation: str | list[Message] = ""
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = {}


class Environment:
    """A convenient base; any class with these members will do."""

    tools: ClassVar[list[dict[str, Any]]] = []
    needs_sandbox: ClassVar[bool] = False

    def __init__(self, sandbox: Sandbox | None = None, **params: Any) -> None:
        self.sandbox = sandbox
        self.params = params

    async def reset(self, task: dict[str, Any]) -> list[Message] | str:
        raise NotImplementedError

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        return None

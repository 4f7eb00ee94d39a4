"""What an environment offers the per-trajectory loop: a prompt, tools, a verdict, reference actions."""

from __future__ import annotations

from typing import Any, Protocol

from msgspec import Struct

from loom.envs.actions import ToolCall
from loom.sandbox import ExecResult

# What the model sees of a tool's output; the rest is cut with a note (as agent scaffolds do).
OBSERVATION_CHARS = 2000


class Observation(Struct, frozen=True):
    text: str
    done: bool = False


class EnvError(Exception):
    """The environment (not the model) failed: retried, then the trajectory ends with this reason."""


class Env(Protocol):
    name: str

    async def reset(self) -> str:
        """Start the episode; returns the prompt (system text and task) the model sees first."""
        ...

    async def step(self, call: ToolCall) -> Observation: ...

    def reference_actions(self) -> list[str]:
        """The actions that solve the task, from its reference solution (for scripted rollouts)."""
        ...

    def verdict(self) -> dict[str, Any]:
        """The outcome the reward reads (``score`` in [0, 1]) and how it was reached."""
        ...

    async def close(self) -> None: ...


def clip(text: str, limit: int = OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [{len(text) - limit} more characters cut]"


def show(r: ExecResult) -> str:
    """A command's result as the model sees it."""
    if r.timed_out:
        return clip(r.stdout + r.stderr) + f"\n[timed out after {r.duration_s:.1f} s]"
    out = (r.stdout + (("\n" if r.stdout and r.stderr else "") + r.stderr if r.stderr else "")).rstrip()
    return clip(out or "(no output)") + ("" if r.exit_code == 0 else f"\n[exit code {r.exit_code}]")


def unknown_tool(call: ToolCall, tools: tuple[str, ...]) -> Observation:
    return Observation(f"Unknown tool {call.name!r}. Available tools: {', '.join(tools)}.")

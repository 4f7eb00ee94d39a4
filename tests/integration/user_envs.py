"""Environments by import path that misbehave, for the tests of failure isolation (loom.envs.api)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from loom.envs.api import Action, EnvError, Environment, StepResult

# Which processes import this module: the tests check that only environment managers ever do.
if os.environ.get("LOOM_TEST_IMPORT_LOG"):
    with open(os.environ["LOOM_TEST_IMPORT_LOG"], "a") as log:
        log.write(" ".join(sys.argv) + "\n")

# Resets that fail transiently, per task id: the manager retries them on a fresh instance.
_FLAKY: dict[str, int] = {}


class Echo(Environment):
    """Says back how many tool calls each reply made; done after ``turns`` steps with reward 0.5."""

    async def reset(self, task: dict[str, Any]) -> str:
        self.left = int(task.get("turns", 2))
        return str(task.get("prompt", "Say something."))

    async def step(self, action: Action) -> StepResult:
        self.left -= 1
        return StepResult(
            f"{len(action.tool_calls)} calls", done=self.left <= 0, reward=0.5 if self.left <= 0 else None
        )


class RaisesInReset(Echo):
    async def reset(self, task: dict[str, Any]) -> str:
        raise RuntimeError("no board for this task")


class FailsToStart(Echo):
    """Cannot start, as GEM's word games without NLTK's corpus: its reset takes a moment, then raises."""

    async def reset(self, task: dict[str, Any]) -> str:
        await asyncio.sleep(0.5)
        raise LookupError("Resource words not found")


class RaisesInStep(Echo):
    async def step(self, action: Action) -> StepResult:
        raise ValueError("bad move")


class HangsInStep(Echo):
    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


class BadInfo(Echo):
    """Puts what cannot be stored with a trajectory into its info."""

    async def step(self, action: Action) -> StepResult:
        return StepResult("ok", done=True, reward=1.0, info={"handle": object()})


class FlakyReset(Echo):
    async def reset(self, task: dict[str, Any]) -> str:
        key = str(task.get("key", ""))
        _FLAKY[key] = _FLAKY.get(key, 0) + 1
        if _FLAKY[key] == 1:
            raise EnvError("the board server is busy")
        return await super().reset(task)

"""Two environments written against ``loom.envs.api``, as a user's package would be.

``Guess``: find a secret number in a range with a ``guess`` tool that answers higher or lower; reward 1 when
found, spread over fewer tries than the budget. ``ShellQuiz``: answer a question about a file by running
shell commands in a sandbox of the trajectory's own (``needs_sandbox``), then calling ``answer``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from loom.envs.api import Action, Environment, StepResult


def _args(call: Any) -> dict[str, Any]:
    try:
        value = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool(name: str, description: str, **properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


class Guess(Environment):
    tools: ClassVar[list[dict[str, Any]]] = [
        _tool("guess", "Guess the secret number.", number={"type": "integer"})
    ]

    async def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.low, self.high = int(task.get("low", 1)), int(task.get("high", 100))
        self.secret = int(task["secret"])
        self.tries = int(task.get("tries", 7))
        self.used = 0
        return [
            {"role": "system", "content": "You are playing a guessing game. Use the guess tool."},
            {
                "role": "user",
                "content": f"I am thinking of a number from {self.low} to {self.high}. "
                f"You have {self.tries} guesses.",
            },
        ]

    async def step(self, action: Action) -> StepResult:
        guesses = [c for c in action.tool_calls if c.function.name == "guess"]
        if not guesses:
            return self._miss("Call the guess tool with a number.")
        number = _args(guesses[0]).get("number")
        if not isinstance(number, int):
            return self._miss("guess needs an integer 'number'.")
        if number == self.secret:
            return StepResult(f"{number} is right.", done=True, reward=1.0, info={"tries": self.used + 1})
        return self._miss(f"{number} is wrong: go {'higher' if number < self.secret else 'lower'}.")

    def _miss(self, text: str) -> StepResult:
        """A try spent; the game is lost (reward 0) when none are left."""
        self.used += 1
        done = self.used >= self.tries
        return StepResult(text, done=done, reward=0.0 if done else None)


class ShellQuiz(Environment):
    """``task``: ``{"files": {"name": "text"}, "question": "...", "answer": "..."}``."""

    needs_sandbox = True
    tools: ClassVar[list[dict[str, Any]]] = [
        _tool("sh", "Run a shell command in your working directory.", command={"type": "string"}),
        _tool("answer", "Give your final answer.", text={"type": "string"}),
    ]

    async def reset(self, task: dict[str, Any]) -> str:
        assert self.sandbox is not None
        await self.sandbox.write_files(dict(task.get("files", {})))
        self.answer = str(task["answer"]).strip()
        self.timeout_s = float(self.params.get("command_timeout_s", 5.0))
        return str(task["question"])

    async def step(self, action: Action) -> StepResult:
        assert self.sandbox is not None
        for call in action.tool_calls:
            args = _args(call)
            if call.function.name == "answer":
                ok = str(args.get("text", "")).strip() == self.answer
                return StepResult("Answer recorded.", done=True, reward=float(ok))
            if call.function.name == "sh":
                r = await self.sandbox.exec(
                    ["sh", "-c", str(args.get("command", ""))], timeout_s=self.timeout_s
                )
                return StepResult((r.stdout + r.stderr)[-2000:] or f"(exit code {r.exit_code})")
        return StepResult("Call sh to look around, then answer.")

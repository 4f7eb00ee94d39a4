"""``math``: GSM8K with a Python calculator in the sandbox. Tools: ``python(code)``; the answer is
given with ``Finish[answer]`` (or a ``finish`` tool call), compared numerically with the gold answer."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from loom.envs.actions import ToolCall, json_call
from loom.envs.base import Observation, show, unknown_tool
from loom.envs.tasksets import MathTask
from loom.sandbox import Sandbox

TOOLS = ("python", "finish")
SYSTEM = (
    "Solve the problem step by step. To calculate, call "
    '<tool_call>{"name": "python", "arguments": {"code": "print(...)"}}</tool_call>. '
    "When you know the answer, reply Finish[answer] with the number alone.\n"
)
# GSM8K solutions annotate each calculation as <<expression=result>>.
_CALC = re.compile(r"<<([^=<>]+)=([^<>]*)>>")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def as_number(text: str) -> Fraction | None:
    """The last number in ``text`` (thousands separators, $ and % ignored), exactly."""
    found = _NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str, gold: str) -> bool:
    a, b = as_number(given), as_number(gold)
    return a is not None and a == b


def reference_actions(task: MathTask) -> list[str]:
    """The solution's calculations as python calls, then its answer."""
    calls = [json_call("python", code=f"print({expr.strip()})") for expr, _ in _CALC.findall(task.solution)]
    return [*calls, f"Thought: the answer is {task.answer}.\nAction: Finish[{task.answer}]"]


class MathEnv:
    name = "math"

    def __init__(self, task: MathTask, sandbox: Sandbox, timeout_s: float = 10.0) -> None:
        self.task = task
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.result: dict[str, Any] = {"score": 0.0, "correct": False, "answer": None}

    async def reset(self) -> str:
        return f"{SYSTEM}\nProblem: {self.task.question}\n"

    async def step(self, call: ToolCall) -> Observation:
        if call.name.lower() == "finish":
            answer = str(call.arguments.get("answer", call.arguments.get("input", "")))
            ok = same_answer(answer, self.task.answer)
            self.result = {"score": float(ok), "correct": ok, "answer": answer}
            return Observation(f"Answer {answer!r} recorded.", done=True)
        if call.name != "python":
            return unknown_tool(call, TOOLS)
        code = call.arguments.get("code", call.arguments.get("input"))
        if not isinstance(code, str):
            return Observation("python needs a 'code' string argument.")
        await self.sandbox.write_files({"calc.py": code})
        return Observation(show(await self.sandbox.exec(["python3", "calc.py"], timeout_s=self.timeout_s)))

    def reference_actions(self) -> list[str]:
        return reference_actions(self.task)

    def verdict(self) -> dict[str, Any]:
        return dict(self.result)

    async def close(self) -> None:
        pass

"""``code``: HumanEval or MBPP. The agent runs Python in its sandbox, then submits a solution that the
task's tests decide. Tools: ``python(code)`` and ``submit(code)``."""

from __future__ import annotations

from typing import Any

from loom.envs.actions import ToolCall, json_call
from loom.envs.base import Observation, show, unknown_tool
from loom.envs.tasksets import CodeTask
from loom.sandbox import Sandbox

TOOLS = ("python", "submit")
SYSTEM = (
    "You are a Python programmer working in a sandbox. Tools (call one per turn as "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>):\n'
    "- python(code): run a Python program and see its output;\n"
    "- submit(code): submit the complete function; hidden tests decide.\n"
)


def reference_actions(task: CodeTask) -> list[str]:
    """Run the reference solution once to see it defines the entry point, then submit it."""
    if task.reference is None:
        raise ValueError(f"{task.id} has no reference solution to script actions from")
    source = task.prompt + task.reference
    probe = f"{source}\n\nprint({task.entry_point!r}, 'defined:', callable({task.entry_point}))\n"
    return [json_call("python", code=probe), json_call("submit", code=source)]


class CodeEnv:
    name = "code"

    def __init__(self, task: CodeTask, sandbox: Sandbox, timeout_s: float = 10.0) -> None:
        self.task = task
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.result: dict[str, Any] = {"score": 0.0, "passed": False, "submitted": False}

    async def reset(self) -> str:
        return f"{SYSTEM}\nComplete this function:\n```python\n{self.task.prompt}```\n"

    async def step(self, call: ToolCall) -> Observation:
        code = call.arguments.get("code", call.arguments.get("input"))
        if call.name not in TOOLS:
            return unknown_tool(call, TOOLS)
        if not isinstance(code, str):
            return Observation(f"{call.name} needs a 'code' string argument.")
        if call.name == "python":
            await self.sandbox.write_files({"main.py": code})
            return Observation(
                show(await self.sandbox.exec(["python3", "main.py"], timeout_s=self.timeout_s))
            )
        await self.sandbox.write_files({"solution_test.py": self.task.test_program(code)})
        r = await self.sandbox.exec(["python3", "solution_test.py"], timeout_s=self.timeout_s)
        passed = r.ok
        self.result = {
            "score": float(passed),
            "passed": passed,
            "submitted": True,
            "exit_code": r.exit_code,
            "timed_out": r.timed_out,
        }
        return Observation("All tests passed." if passed else "Tests failed:\n" + show(r), done=True)

    def reference_actions(self) -> list[str]:
        return reference_actions(self.task)

    def verdict(self) -> dict[str, Any]:
        return dict(self.result)

    async def close(self) -> None:
        pass

"""``vf-calc``: a multi-turn tool environment written against Prime Intellect's verifiers (0.3), packaged as
verifiers environments are (a module named after the environment's id that exports ``load_environment``), with
nothing of Loom in it.

Each task is an arithmetic question. The model has an ``add`` and a ``multiply`` tool and takes turns until it
replies ``Answer: <number>`` or its ``max_turns`` run out: a tool call is answered with the tool's result, a reply
that neither calls a tool nor answers is asked again. The reward is 1.0 for the right answer, else 0.0; the
rubric also reports whether a tool returned the answer. The data is built in memory, so the environment needs
no network.
"""

from __future__ import annotations

import re
from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM = "Use the tools to compute the answer, one call per turn. When you know it, reply 'Answer: <number>'."
ASK_AGAIN = "Call a tool, or reply 'Answer: <number>'."
ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def questions(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = 2 + i % 5, 3 + i % 4
        if i % 2:
            rows.append({"question": f"What is {a} times {b}?", "answer": str(a * b)})
        else:
            rows.append({"question": f"What is {a} plus {b}?", "answer": str(a + b)})
    return rows


def _answered(message: Any) -> str | None:
    found = ANSWER.search(str(getattr(message, "content", None) or ""))
    return found.group(1) if found else None


def right_answer(completion: Any, answer: str) -> float:
    """1.0 when the last reply answers with the right number."""
    replies = [m for m in completion if m.role == "assistant"]
    return float(bool(replies) and _answered(replies[-1]) == answer)


def tool_gave_answer(completion: Any, answer: str) -> float:
    """1.0 when a tool's reply in the completion is the answer."""
    return float(any(m.role == "tool" and str(m.content).strip() == answer for m in completion))


class CalcEnv(vf.ToolEnv):
    """A ``ToolEnv`` that ends on an answer rather than on the first reply without a tool call."""

    @vf.stop
    async def no_tools_called(self, state: vf.State) -> bool:
        if not state["trajectory"]:
            return False
        last = state["trajectory"][-1]["completion"][-1]
        return (
            last.role == "assistant" and not getattr(last, "tool_calls", None) and _answered(last) is not None
        )

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        if getattr(messages[-1], "tool_calls", None):
            return await super().env_response(messages, state, **kwargs)
        return [vf.UserMessage(content=ASK_AGAIN)]


def load_environment(n: int = 8, max_turns: int = 4) -> vf.Environment:
    """``n`` questions; at most ``max_turns`` model calls a rollout."""
    rubric = vf.Rubric(funcs=[right_answer, tool_gave_answer], weights=[1.0, 0.0])
    return CalcEnv(
        dataset=Dataset.from_list(questions(n)),
        system_prompt=SYSTEM,
        tools=[add, multiply],
        max_turns=max_turns,
        rubric=rubric,
    )

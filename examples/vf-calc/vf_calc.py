"""``vf-calc``: a multi-turn tool environment written against Prime Intellect's verifiers (0.3), packaged as
verifiers environments are (a module named after the environment's id that exports ``load_environment``), with
nothing of Loom in it.

Each task is an arithmetic question. The model has an ``add`` and a ``multiply`` tool and as many turns as it
needs (up to ``max_turns``); the rollout ends when a reply calls no tool. The reward is 1.0 when a tool returned
the answer, else 0.0, and ``tool_calls`` counts the calls the model made. The data is built in memory, so the
environment needs no network.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

SYSTEM = (
    "Use the tools to compute the answer, one call per turn. Reply without a tool call when you are done."
)


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


def tool_gave_answer(completion: Any, answer: str) -> float:
    """1.0 when a tool's reply in the completion is the answer."""
    return float(any(m.role == "tool" and str(m.content).strip() == answer for m in completion))


def load_environment(n: int = 8, max_turns: int = 4) -> vf.Environment:
    """``n`` questions; at most ``max_turns`` model calls a rollout."""
    dataset = Dataset.from_list(questions(n))
    rubric = vf.Rubric(funcs=[tool_gave_answer], weights=[1.0])
    return vf.ToolEnv(
        dataset=dataset,
        system_prompt=SYSTEM,
        tools=[add, multiply],
        max_turns=max_turns,
        rubric=rubric,
    )

"""Reward functions: math (every GSM8K answer against itself and altered), the judge's grade parsing,
code extraction, and user functions by import path (verl's compute_score convention)."""

from __future__ import annotations

import asyncio
import sys
from fractions import Fraction

import pytest

from loom.envs import tasksets
from loom.protocol import RewardRequest, Step, TaskSpec, Trajectory
from loom.protocol.messages import BUILTIN_REWARDS
from loom.rewards.code_reward import extract_code, program
from loom.rewards.context import RewardContext, RewardError
from loom.rewards.judge import judge_prompt, parse_score
from loom.rewards.math_reward import extract_answer, math_score
from loom.rewards.registry import BUILTIN, score
from tests.conftest import need_shared


def _req(kind: str, action: str, task: TaskSpec | None = None, params: dict | None = None) -> RewardRequest:
    traj = Trajectory(
        "j", "t0", "x", 0, 0, "math", "completed", "stop", [Step(0, 5, 5, action=action)], 0.0, 1.0
    )
    return RewardRequest(traj, kind, "default", task, params or {})


def _altered(answer: str) -> str:
    return str(Fraction(answer) + 1)


def test_every_gsm8k_answer_scores_1_against_itself_and_0_altered() -> None:
    need_shared("data/tasks")
    tasks = list(tasksets.gsm8k().values())
    assert len(tasks) == 1319
    assert all(math_score(t.solution, t.answer) == 1.0 for t in tasks)
    assert all(math_score(f"#### {_altered(t.answer)}", t.answer) == 0.0 for t in tasks)
    # Written as a model would: a LaTeX boxed answer goes through math-verify.
    for t in tasks[:100]:
        assert math_score(f"So the answer is $\\boxed{{{t.answer}}}$.", t.answer) == 1.0
        assert math_score(f"So the answer is $\\boxed{{{_altered(t.answer)}}}$.", t.answer) == 0.0


def test_math_equivalence_and_answer_extraction() -> None:
    assert math_score("the result is $\\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert math_score("Finish[1,000]", "1000") == 1.0
    assert math_score('<tool_call>{"name": "finish", "arguments": {"answer": "42"}}</tool_call>', "42") == 1.0
    assert math_score("no idea", "7") == 0.0
    assert extract_answer("work...\n#### 18") == "18"


def test_math_reward_reads_the_ground_truth_of_the_task_set() -> None:
    need_shared("data/tasks")
    t = tasksets.gsm8k()["gsm8k-test/0"]
    spec = TaskSpec(t.id, {"set": "gsm8k"})
    assert asyncio.run(score(_req("math", t.solution, spec), RewardContext())) == 1.0
    assert asyncio.run(score(_req("math", "#### 0", spec), RewardContext())) == 0.0
    with pytest.raises(RewardError, match="ground truth"):
        asyncio.run(score(_req("math", "#### 0"), RewardContext()))


def test_judge_grades_are_parsed_and_checked() -> None:
    assert parse_score("The answer is right.\nScore: 8") == 0.8
    assert parse_score("Rating: [[3]]") == 0.3
    assert parse_score("score = 4/5", scale=10) == 0.8
    assert parse_score("**Score:** 10") == 1.0
    with pytest.raises(RewardError, match="no score"):
        parse_score("I think it is good")
    with pytest.raises(RewardError, match="outside"):
        parse_score("Score: 14")
    p = judge_prompt("What is 2+2?", "4", "4")
    assert "Reference answer:\n4" in p and p.endswith("Grade:")


def test_code_extraction_and_program() -> None:
    need_shared("data/tasks")
    t = tasksets.humaneval()["HumanEval/0"]
    assert extract_code("```python\nx = 1\n```") == "x = 1\n"
    assert (
        extract_code('<tool_call>{"name": "submit", "arguments": {"code": "y = 2"}}</tool_call>') == "y = 2"
    )
    assert program(t, t.reference or "").startswith(t.prompt)  # a completion of the prompt
    full = t.prompt + (t.reference or "")
    assert program(t, full).startswith(full) and full + full not in program(t, full)


def test_user_functions_by_import_path() -> None:
    spec = TaskSpec("x", {"ground_truth": "42"})
    ctx = RewardContext()
    assert (
        asyncio.run(score(_req("tests.integration.reward_fns:busy", "42", spec, {"busy_s": 0}), ctx)) == 1.0
    )
    assert asyncio.run(score(_req("tests.integration.reward_fns:verdict", "x", spec), ctx)) == 0.5
    with pytest.raises(RewardError, match="cannot load"):
        asyncio.run(score(_req("tests.integration.reward_fns:missing", "x", spec), ctx))
    with pytest.raises(RuntimeError, match="always fails"):
        asyncio.run(score(_req("tests.integration.reward_fns:broken", "x", spec), ctx))
    with pytest.raises(RewardError, match="no reward function"):
        asyncio.run(score(_req("nonsense", "x", spec), ctx))
    # A worker imports nothing outside the operator's allowlist, whoever asked (the scheduler checks too).
    with pytest.raises(RewardError, match="allowlist"):
        asyncio.run(score(_req("antigravity:fly", "x", spec), ctx))
    assert "antigravity" not in sys.modules
    # The scheduler refuses unknown names by the protocol's list; the registry implements exactly it.
    assert tuple(BUILTIN) == BUILTIN_REWARDS

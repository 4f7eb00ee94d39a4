"""Code reward: the response's program runs against the task's tests in a sandbox; 1 when they pass."""

from __future__ import annotations

import re

from loom.envs.tasksets import CodeTask
from loom.protocol import RewardRequest
from loom.rewards.context import RewardContext, RewardError, call_argument, ground_truth, response_text

_FENCE = re.compile(r"```(?:python|py)?\n(.*?)```", re.S)
TIMEOUT_S = 10.0


def extract_code(text: str) -> str:
    """A ``submit``/``python`` call's code, else the last fenced block, else the text as it is."""
    arg = call_argument(text, ("submit", "python"))
    if arg is not None:
        return arg
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def program(task: CodeTask, code: str) -> str:
    """Complete source when the code defines the entry point, else a completion of the prompt."""
    defines = re.search(rf"^\s*def\s+{re.escape(task.entry_point)}\s*\(", code, re.M)
    return task.test_program(code) if defines else task.program(code)


async def code_reward(req: RewardRequest, ctx: RewardContext) -> float:
    task = ground_truth(req)
    if not isinstance(task, CodeTask):
        raise RewardError("code reward needs a code task (HumanEval or MBPP) with tests")
    source = program(task, extract_code(response_text(req.trajectory)))
    timeout = float(req.params.get("timeout_s", TIMEOUT_S))
    pool = await ctx.sandbox_pool()
    async with pool.session(f"reward-{req.trajectory.job_id}-{req.trajectory.traj_id}") as sb:
        await sb.write_files({"solution_test.py": source})
        r = await sb.exec(["python3", "solution_test.py"], timeout_s=timeout)
    return float(r.ok)

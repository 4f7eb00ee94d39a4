"""The code reward on HumanEval: every canonical solution scores 1 in a Docker sandbox, a broken one 0."""

from __future__ import annotations

import asyncio

from loom.envs import tasksets
from loom.protocol import RewardRequest, Step, TaskSpec, Trajectory
from loom.rewards.context import RewardContext
from loom.rewards.registry import score
from loom.sandbox import Limits
from loom.sandbox.docker_backend import DockerBackend
from loom.sandbox.pool import SandboxPool
from tests.conftest import need_shared


def _req(task_id: str, text: str) -> RewardRequest:
    traj = Trajectory(
        "j", task_id, task_id, 0, 0, "code", "completed", "stop", [Step(0, 5, 5, action=text)], 0.0, 1.0
    )
    return RewardRequest(traj, "code", "default", TaskSpec(task_id, {"set": "humaneval"}))


async def test_humaneval_canonical_solutions_score_1_through_the_code_reward(sandbox_image: str) -> None:
    need_shared("data/tasks")
    tasks = list(tasksets.humaneval().values())
    backend = DockerBackend(sandbox_image, pool="test-code-reward")
    pool = SandboxPool(backend, Limits(cpus=1.0, memory_mb=256, pids=64), warm=4, max_sandboxes=8)
    await pool.start()
    ctx = RewardContext(lambda: _ready(pool))
    sem = asyncio.Semaphore(8)

    async def one(text: str, task_id: str) -> float | None:
        async with sem:
            return await score(_req(task_id, text), ctx)

    try:
        # As a model would answer: the completed function in a fenced block.
        good = await asyncio.gather(*(one(f"```python\n{t.prompt}{t.reference}```", t.id) for t in tasks))
        bad = await asyncio.gather(*(one("    return None\n", t.id) for t in tasks[:10]))
    finally:
        await pool.close()
        await backend.close()
    assert len(good) == 164 and all(r == 1.0 for r in good)
    assert all(r == 0.0 for r in bad)


async def _ready(pool: SandboxPool) -> SandboxPool:
    return pool

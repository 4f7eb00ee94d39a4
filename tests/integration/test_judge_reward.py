"""The judge reward's path: its grading prompt goes through the router to a rollout worker's engine.

The simulated engine answers a request of token ids with placeholder tokens (a model with random weights),
which state no grade: the reward must say exactly that (the request is then dead-lettered and its trajectory
stored unscored, never scored at random). The grade parsing itself is tested on judge-style replies in tests/unit/test_rewards.py."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS

from loom.protocol import RewardRequest, Step, TaskSpec, Trajectory, TrajMeta, decode, subjects
from loom.rewards.context import RewardContext, RewardError
from loom.rewards.registry import score
from loom.runtime.bus import kv_key
from tests.conftest import Services
from tests.integration.helpers import start_router, start_worker, until


async def test_judge_prompt_goes_through_router_and_engine(nc: NATS, services: Services) -> None:
    await start_worker(services, "w0")
    router = await start_router(services)
    await until(lambda: set(router.workers) == {"w0"})
    traj = Trajectory(
        "job-j", "t0", "q", 0, 0, "math", "completed", "stop", [Step(0, 5, 5, action="4")], 0.0, 1.0
    )
    req = RewardRequest(
        traj, "judge", "default", TaskSpec("q", {"prompt": "What is 2+2?"}), {"judge_max_tokens": 24}
    )
    with pytest.raises(RewardError, match="judge reply states no score"):
        await score(req, RewardContext(nc=nc))
    # The router placed the judge's call as a job of its own, not as a step of the graded trajectory.
    kv = await nc.jetstream().key_value(subjects.KV_TRAJ)
    assert decode((await kv.get(kv_key("judge-job-j", "t0"))).value or b"", TrajMeta).worker_id == "w0"
    with pytest.raises(RewardError, match="bus connection"):
        await score(req, RewardContext())

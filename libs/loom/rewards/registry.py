"""Reward functions by name: the built-ins, and user functions registered by import path ``module:fn``.

A user function follows verl's ``compute_score`` convention, so existing ones run unchanged:
``fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}``, sync or async.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from loom.identity import allowlist
from loom.protocol import RewardRequest
from loom.rewards.code_reward import code_reward
from loom.rewards.context import RewardContext, RewardError, ground_truth, response_text
from loom.rewards.env_verdict import env_verdict
from loom.rewards.judge import judge_reward
from loom.rewards.math_reward import math_reward
from loom.rewards.replay import replay_reward

RewardFn = Callable[[RewardRequest, RewardContext], float | Awaitable[float]]


def _replay(req: RewardRequest, ctx: RewardContext) -> float:
    return replay_reward(req.trajectory, req.trajectory.info.get("traces_path"))


def _env(req: RewardRequest, ctx: RewardContext) -> float:
    return env_verdict(req.trajectory)


BUILTIN: dict[str, RewardFn] = {
    "replay": _replay,
    "env": _env,
    "math": math_reward,
    "code": code_reward,
    "judge": judge_reward,
}
# CPU-bound built-ins run in a thread so that a worker keeps answering the bus meanwhile.
_THREADED = frozenset({"replay", "math"})


@functools.cache
def _user_fn(path: str) -> Callable[..., Any]:
    try:
        # The scheduler checked too; nothing is imported that was not allowed.
        return allowlist.load(path, "reward function")
    except allowlist.NotLoaded as e:
        raise RewardError(str(e)) from e


async def _call_user(path: str, req: RewardRequest) -> float:
    fn = _user_fn(path)
    try:
        truth = ground_truth(req)
    except RewardError:
        truth = None
    kwargs = {
        "data_source": req.task.data.get("set", "") if req.task else "",
        "solution_str": response_text(req.trajectory),
        "ground_truth": truth,
        "extra_info": {
            "job_id": req.trajectory.job_id,
            "traj_id": req.trajectory.traj_id,
            "task_id": req.trajectory.task_id,
            "params": req.params,
            "info": req.trajectory.info,
        },
    }
    if inspect.iscoroutinefunction(fn):
        out = await fn(**kwargs)
    else:
        out = await asyncio.to_thread(fn, **kwargs)
    if isinstance(out, dict):
        out = out.get("score")
    if isinstance(out, bool) or not isinstance(out, int | float):
        raise RewardError(f"reward function {path!r} returned {out!r}, not a number")
    return float(out)


def known(kind: str) -> bool:
    return kind in BUILTIN or ":" in kind


async def score(req: RewardRequest, ctx: RewardContext) -> float | None:
    """The reward, or None for a trajectory that did not complete (it is stored, unscored)."""
    if req.trajectory.status != "completed":
        return None
    if ":" in req.kind:
        return await _call_user(req.kind, req)
    fn = BUILTIN.get(req.kind)
    if fn is None:
        raise RewardError(f"no reward function {req.kind!r}; built-ins: {sorted(BUILTIN)}")
    if req.kind in _THREADED:
        out = await asyncio.to_thread(fn, req, ctx)
    else:
        out = fn(req, ctx)
    if inspect.isawaitable(out):
        out = await out
    return float(out)

"""What a reward function gets besides the request: the response text, the ground truth, and services
(sandboxes for code, the router for a judge) that a worker opens once and shares between requests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from loom.envs import registry
from loom.envs.actions import ParseError, parse
from loom.envs.tasksets import CodeTask, MathTask
from loom.protocol import RewardRequest, Trajectory
from loom.sandbox.pool import SandboxPool


class RewardError(ValueError):
    """The request cannot be scored as it stands (retrying will not help)."""


class RewardContext:
    def __init__(
        self,
        sandboxes: Callable[[], Awaitable[SandboxPool]] | None = None,
        nc: Any = None,
    ) -> None:
        self._sandboxes = sandboxes
        self.nc = nc

    async def sandbox_pool(self) -> SandboxPool:
        if self._sandboxes is None:
            raise RewardError("this reward worker has no sandboxes")
        return await self._sandboxes()


def response_text(traj: Trajectory) -> str:
    """The model's final answer: the last step's action (a tool call's argument when it is one)."""
    for step in reversed(traj.steps):
        if step.action.strip():
            return step.action
    raise RewardError(f"trajectory {traj.traj_id} has no response text to score")


def call_argument(text: str, names: tuple[str, ...]) -> str | None:
    """The code/answer argument of a final tool call such as ``submit(code)`` or ``Finish[x]``."""
    try:
        call = parse(text)
    except ParseError:
        return None
    if call.name.lower() not in names:
        return None
    for key in ("code", "answer", "input"):
        v = call.arguments.get(key)
        if isinstance(v, str):
            return v
    return None


def task_record(req: RewardRequest) -> Any | None:
    """The task-set record behind the request's task (None for inline tasks without a set)."""
    if req.task is None or "set" not in req.task.data:
        return None
    try:
        return registry.task_of(req.task)
    except KeyError as e:
        raise RewardError(f"unknown task {req.task.id!r} in {req.task.data.get('set')!r}") from e


def ground_truth(req: RewardRequest) -> Any:
    """The job's ``ground_truth`` parameter, the task's own, or the answer/tests of its task-set record."""
    if "ground_truth" in req.params:
        return req.params["ground_truth"]
    if req.task is not None and "ground_truth" in req.task.data:
        return req.task.data["ground_truth"]
    rec = task_record(req)
    if isinstance(rec, MathTask):
        return rec.answer
    if isinstance(rec, CodeTask):
        return rec
    if rec is not None and hasattr(rec, "answer"):
        return rec.answer
    raise RewardError(f"trajectory {req.trajectory.traj_id} has no ground truth (no task set, no parameter)")

"""What every per-trajectory loop is given by its manager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from prometheus_client import Counter, Histogram

from loom.clock import Clock
from loom.genclient import GenClient
from loom.protocol import Step, Trajectory, TrajStatus, TrajWork


class TrajectoryAborted(Exception):
    """The engine aborted a generation (job cancelled, worker lost): the trajectory ends, unscored."""


@dataclass
class EnvMetrics:
    reset_s: Histogram
    step_s: Histogram
    failures: Counter


@dataclass
class LoopContext:
    nc: NATS
    clock: Clock
    gen: GenClient
    predict_timeout_s: float
    metrics: EnvMetrics | None = None


def trajectory(
    work: TrajWork,
    status: TrajStatus,
    finish_reason: str,
    steps: list[Step],
    started: float,
    finished: float,
    info: dict[str, Any],
) -> Trajectory:
    """The trajectory record of a work item, as every loop and the manager's failure path write it."""
    return Trajectory(
        job_id=work.job_id,
        traj_id=work.traj_id,
        task_id=work.task.id,
        group=work.group,
        sample=work.sample,
        env=work.env,
        status=status,
        finish_reason=finish_reason,
        steps=steps,
        started_at=started,
        finished_at=finished,
        info=info,
    )

"""What every per-trajectory loop is given by its manager."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client as NATS
from prometheus_client import Counter, Histogram

from loom.clock import Clock
from loom.genclient import GenClient


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

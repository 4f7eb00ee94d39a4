"""Queue orders (Heddle §4.2 and its baselines). Each maps a request's metadata to a sort key.

- ``Fcfs``: trajectory-level first come, first served: a trajectory keeps the place it got with its first
  request, so returning from a tool does not send it to the back.
- ``RoundRobin``: the per-step order of verl and slime: every step is a new request at the tail.
- ``Pps``: progressive priority scheduling, longest predicted remaining work first (LPT), with
  preemption of the lowest-priority running request when a waiting one outranks it (Algorithm 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class RequestMeta:
    traj: str
    step: int
    priority: float = 0.0  # predicted remaining tokens of the trajectory (larger = longer)
    traj_arrival: float = 0.0  # when the trajectory's first request arrived
    arrival: float = 0.0  # when this request arrived
    attained: float = 0.0  # service the trajectory has had so far (tokens generated)
    seq: int = 0  # tie-breaker, set by the queue


class OrderPolicy(Protocol):
    name: str
    preemptive: bool

    def key(self, m: RequestMeta) -> tuple[Any, ...]: ...


class Fcfs:
    name = "fcfs"
    preemptive = False

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        return (m.traj_arrival, m.step, m.seq)


class RoundRobin:
    name = "rr"
    preemptive = False

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        return (m.arrival, m.seq)


class Pps:
    name = "pps"
    preemptive = True

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        return (-m.priority, m.traj_arrival, m.seq)


def preemption_victim(waiting_priority: float, running: Sequence[tuple[str, float]]) -> str | None:
    """Algorithm 1, lines 6-9: the running request to evict for the head of the queue, if any."""
    if not running:
        return None
    rid, lowest = min(running, key=lambda r: (r[1], r[0]))
    return rid if waiting_priority > lowest else None

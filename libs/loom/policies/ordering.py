"""Queue orders (Heddle §4.2 and its baselines). Each maps a request's metadata to a sort key.

- ``Fcfs``: trajectory-level first come, first served: a trajectory keeps the place it got with its first
  request, so returning from a tool does not send it to the back.
- ``RoundRobin``: the per-step order of verl and slime: every step is a new request at the tail.
- ``Pps``: progressive priority scheduling, longest predicted trajectory first (LPT), with preemption of the
  lowest-priority running request when a waiting one outranks it (Algorithm 1). A trajectory's priority is
  the longest its estimates have said (``held``).
- ``Plas``: Autellix's program-level attained service (the least-served program first), the baseline
  of the Heddle scheduling ablation.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class RequestMeta:
    traj: str
    step: int
    priority: float = 0.0  # the trajectory's predicted total length, as ``held`` (larger = longer)
    traj_arrival: float = 0.0  # when the trajectory's first request arrived
    arrival: float = 0.0  # when this request arrived
    attained: float = 0.0  # service the trajectory has had so far (tokens generated)
    attained_s: float = 0.0  # the same in engine seconds (Autellix's anti-starvation ratio)
    waited: float = 0.0  # time the trajectory's earlier calls spent waiting (Autellix)
    seq: int = 0  # tie-breaker, set by the queue


class OrderPolicy(Protocol):
    name: str
    preemptive: bool

    def key(self, m: RequestMeta) -> tuple[Any, ...]: ...

    def engine_priority(self, m: RequestMeta) -> float:
        """The priority handed to the engine (larger first); 0 where the engine should not reorder."""
        ...


class _NoEnginePriority:
    def engine_priority(self, m: RequestMeta) -> float:
        return 0.0


class Fcfs(_NoEnginePriority):
    name = "fcfs"
    preemptive = False

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        return (m.traj_arrival, m.step, m.seq)


class RoundRobin(_NoEnginePriority):
    name = "rr"
    preemptive = False

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        return (m.arrival, m.seq)


class Pps:
    name = "pps"
    preemptive = True

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        return (-m.priority, m.traj_arrival, m.seq)

    def engine_priority(self, m: RequestMeta) -> float:
        return m.priority


def held(previous: float | None, estimate: float) -> float:
    """A trajectory's PPS priority once a new estimate of its length comes: the longest any estimate has said.

    Heddle's priority (Algorithm 1, line 3) is the predicted length, which should stay put as a trajectory
    progresses. Loom's served estimates do not: each step range has its own regression, and a finished sibling
    moves them (``loom.predict.combine``), so a trajectory can drop below others mid-rollout, be preempted and
    queue, on no evidence that it got shorter. Keeping the highest makes the order a trajectory earned stick:
    in ``loom bench heddle-suite``'s coding cells (Qwen3-14B, 64 GPUs) the makespan over the lower bound fell
    from 1.158 to 1.075 (the oracle's order: 1.066); an exact estimate never moves, so nothing changes there.
    """
    return estimate if previous is None else max(previous, estimate)


def preemption_victim(waiting_priority: float, running: Sequence[tuple[str, float]]) -> str | None:
    """Algorithm 1, lines 6-9: the running request to evict for the head of the queue, if any."""
    if not running:
        return None
    rid, lowest = min(running, key=lambda r: (r[1], r[0]))
    return rid if waiting_priority > lowest else None


class Plas:
    """Autellix PLAS: program-level attained service in multi-level feedback queues.

    A call enters the queue of its program's attained service (service of its completed calls); queues are
    served in order, FCFS within one; a call that has waited ``beta`` times the service its program got is
    promoted to the first queue (anti-starvation). The paper gives no values for the number of queues,
    their bounds or beta: queue bounds follow the geometric bins of a public reimplementation
    (first_quantum * 2^i, cumulative), in tokens of service here; ``beta`` is an assumption.
    """

    name = "autellix"
    preemptive = True

    def __init__(self, first_quantum: float = 512.0, levels: int = 8, beta: float = 2.0) -> None:
        bounds, total = [], 0.0
        for i in range(levels - 1):
            total += first_quantum * 2**i
            bounds.append(total)
        self.bounds = bounds
        self.beta = beta
        self.now = 0.0  # advanced by the owner before re-keying; keys age with it

    def level(self, attained: float) -> int:
        return bisect.bisect_right(self.bounds, attained)

    def key(self, m: RequestMeta) -> tuple[Any, ...]:
        waited = m.waited + max(0.0, self.now - m.arrival)
        starving = waited >= self.beta * max(m.attained_s, 1e-3)
        return (0 if starving else self.level(m.attained), m.arrival, m.seq)

    def engine_priority(self, m: RequestMeta) -> float:
        return -float(self.level(m.attained))


def make_order(name: str) -> OrderPolicy:
    orders: dict[str, type] = {"fcfs": Fcfs, "rr": RoundRobin, "pps": Pps, "autellix": Plas}
    if name not in orders:
        raise ValueError(f"unknown queue order {name!r}; one of {sorted(orders)}")
    policy: OrderPolicy = orders[name]()
    return policy

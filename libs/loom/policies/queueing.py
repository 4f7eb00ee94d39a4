"""Admission queues: the order in which a worker's waiting requests go to its engine.

The queue is a heap with lazy deletion; the order comes from an ``OrderPolicy`` (policies/ordering.py)
that turns what is known of a request into a sort key (smaller first). A trajectory's waiting requests
can be re-keyed when its prediction changes, which reorders the queue.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from loom.policies.ordering import Fcfs, OrderPolicy, RequestMeta

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[Any, ...]
    rid: str = field(compare=False)
    meta: RequestMeta = field(compare=False)
    item: T = field(compare=False)


class AdmissionQueue(Generic[T]):
    def __init__(self, policy: OrderPolicy | None = None) -> None:
        self.policy: OrderPolicy = policy or Fcfs()
        self._heap: list[_Entry[T]] = []
        self._live: dict[str, _Entry[T]] = {}
        self._seq = itertools.count()

    def push(self, rid: str, item: T, meta: RequestMeta | None = None) -> None:
        if rid in self._live:
            return
        meta = meta or RequestMeta(traj="", step=0)
        meta.seq = next(self._seq)
        self._insert(_Entry(self.policy.key(meta), rid, meta, item))

    def _insert(self, e: _Entry[T]) -> None:
        self._live[e.rid] = e
        heapq.heappush(self._heap, e)

    def peek(self) -> tuple[str, RequestMeta] | None:
        while self._heap:
            e = self._heap[0]
            if self._live.get(e.rid) is e:
                return e.rid, e.meta
            heapq.heappop(self._heap)
        return None

    def pop(self) -> tuple[str, T] | None:
        while self._heap:
            e = heapq.heappop(self._heap)
            if self._live.get(e.rid) is e:
                del self._live[e.rid]
                return e.rid, e.item
        return None

    def remove(self, rid: str) -> T | None:
        e = self._live.pop(rid, None)
        return None if e is None else e.item

    def reprioritize(self, traj: str, priority: float) -> int:
        """A trajectory's new priority (its predicted length, as ``ordering.held`` keeps it): re-key its
        waiting requests."""
        n = 0
        for e in [e for e in self._live.values() if e.meta.traj == traj]:
            e.meta.priority = priority
            self._insert(_Entry(self.policy.key(e.meta), e.rid, e.meta, e.item))
            n += 1
        return n

    def rekey_all(self) -> None:
        """Recompute every key (for orders that age, e.g. anti-starvation promotion)."""
        live = list(self._live.values())
        self._heap = [_Entry(self.policy.key(e.meta), e.rid, e.meta, e.item) for e in live]
        self._live = {e.rid: e for e in self._heap}
        heapq.heapify(self._heap)

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def __len__(self) -> int:
        return len(self._live)

    def items(self) -> list[tuple[str, T]]:
        return [(e.rid, e.item) for e in self._live.values()]

    def ordered(self) -> list[str]:
        return [e.rid for e in sorted(self._live.values())]


class WorkerQueue(Generic[T]):
    """A worker's waiting requests across jobs: each job's requests in its own order, jobs served round
    robin so that one job's policy (or size) never starves another's."""

    def __init__(self) -> None:
        self.jobs: dict[str, AdmissionQueue[T]] = {}
        self._job_of: dict[str, str] = {}
        self._turn = 0

    def push(self, job: str, rid: str, item: T, meta: RequestMeta, policy: OrderPolicy) -> None:
        q = self.jobs.get(job)
        if q is None:
            q = self.jobs[job] = AdmissionQueue(policy)
        q.push(rid, item, meta)
        self._job_of[rid] = job

    def pop(self) -> tuple[str, T] | None:
        live = [j for j, q in self.jobs.items() if len(q)]
        if not live:
            return None
        job = live[self._turn % len(live)]
        self._turn += 1
        out = self.jobs[job].pop()
        if out is not None:
            self._job_of.pop(out[0], None)
        return out

    def remove(self, rid: str) -> T | None:
        job = self._job_of.pop(rid, None)
        return None if job is None else self.jobs[job].remove(rid)

    def reprioritize(self, job: str, traj: str, priority: float) -> int:
        q = self.jobs.get(job)
        return 0 if q is None else q.reprioritize(traj, priority)

    def drop_job(self, job: str) -> list[tuple[str, T]]:
        q = self.jobs.pop(job, None)
        items = q.items() if q is not None else []
        for rid, _ in items:
            self._job_of.pop(rid, None)
        return items

    def items(self) -> list[tuple[str, T]]:
        return [it for q in self.jobs.values() for it in q.items()]

    def __contains__(self, rid: str) -> bool:
        return rid in self._job_of

    def __len__(self) -> int:
        return len(self._job_of)

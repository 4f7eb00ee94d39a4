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
        """New predicted remaining length for a trajectory: re-key its waiting requests."""
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

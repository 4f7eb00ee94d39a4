"""Admission queues: the order in which a worker's waiting requests are forwarded to its engine."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    key: tuple[float, int]
    rid: str = field(compare=False)
    item: T = field(compare=False)


class FcfsQueue(Generic[T]):
    """First come, first served, with removal by request id (abort, cancel)."""

    def __init__(self) -> None:
        self._heap: list[_Entry[T]] = []
        self._live: dict[str, _Entry[T]] = {}
        self._seq = itertools.count()

    def key(self, priority: float, seq: int) -> tuple[float, int]:
        return (0.0, seq)

    def push(self, rid: str, item: T, priority: float = 0.0) -> None:
        if rid in self._live:
            return
        e = _Entry(self.key(priority, next(self._seq)), rid, item)
        self._live[rid] = e
        heapq.heappush(self._heap, e)

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

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def __len__(self) -> int:
        return len(self._live)

    def items(self) -> list[tuple[str, T]]:
        return [(e.rid, e.item) for e in self._live.values()]

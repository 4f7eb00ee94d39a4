"""Prefix cache of the simulated engine: one cached length per ``prefix_key``.

A key stands for one trajectory's growing context, so a radix tree reduces to a length per key. Running
requests pin the part of their key's entry they reuse; the tail beyond the longest pin and every
unpinned entry are evictable, tail first, as a radix cache evicts leaves first.

Eviction takes least recently used entries first (SGLang's default), or with ``by_priority`` the entries
of the lowest-priority trajectories first (LRU among equals): under Heddle's progressive priority a long
trajectory's context survives its tool calls instead of going to whichever short one is admitted next,
and "persist KV cache" (Algorithm 1, line 8) holds for the trajectories that set the makespan.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Entry:
    length: int = 0
    pin: int = 0
    holders: dict[str, int] = field(default_factory=dict)  # rid -> tokens of this entry it reuses
    priority: float = 0.0
    stamp: int = 0  # its place in the eviction order; heap items with another stamp are stale


class PrefixCache:
    def __init__(
        self, by_priority: bool = False, on_evict: Callable[[str, int, float], None] | None = None
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        self.by_priority = by_priority
        # Told (key, length before, priority) whenever eviction shortens an entry: a host tier keeps it.
        self.on_evict = on_evict
        # Keys with evictable tokens in eviction order, (priority, stamp, key), stale items skipped: eviction
        # never walks past pinned entries.
        self._order: list[tuple[float, int, str]] = []
        self._clock = itertools.count(1)
        self.tokens = 0
        self.evictable = 0

    def __len__(self) -> int:
        return len(self._entries)

    def length(self, key: str) -> int:
        entry = self._entries.get(key)
        return entry.length if entry else 0

    def pin_gain(self, key: str, cached: int) -> int:
        """Evictable tokens that ``acquire(key, _, cached)`` would pin."""
        entry = self._entries.get(key)
        return max(0, cached - (entry.pin if entry else 0))

    def acquire(self, key: str, rid: str, cached: int, priority: float = 0.0) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        if self.by_priority:
            entry.priority = priority
        if cached > entry.length:
            raise ValueError(f"{rid} reuses {cached} tokens of {key!r}, which holds {entry.length}")
        entry.holders[rid] = cached
        self._set(key, entry, entry.length, max(entry.pin, cached))

    def release(self, key: str, rid: str, length: int | None) -> None:
        """Drop ``rid``'s pin; ``length`` (its computed context) becomes the key's cached length, though never
        below what the remaining holders reuse. ``None`` leaves the length as it is (an abort)."""
        entry = self._entries[key]
        del entry.holders[rid]
        pin = max(entry.holders.values(), default=0)
        self._set(key, entry, entry.length if length is None else max(length, pin), pin)

    def insert(self, key: str, length: int, priority: float | None = None) -> None:
        """Make ``key`` hold at least ``length`` tokens (an imported prefix); the tail is evictable."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        if priority is not None and self.by_priority:
            entry.priority = priority
        self._set(key, entry, max(entry.length, length), entry.pin)

    def trim(self, key: str) -> None:
        """Drop what no running request reuses of ``key`` (an exported prefix that moved away)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._set(key, entry, entry.pin, entry.pin)

    def evict(self, tokens: int, spare: str | None = None) -> int:
        """Free up to ``tokens`` from entries other than ``spare``, in eviction order; return how many
        were freed."""
        freed = 0
        kept = []
        while freed < tokens and self._order:
            prio, stamp, key = heapq.heappop(self._order)
            entry = self._entries.get(key)
            if entry is None or entry.stamp != stamp or entry.length == entry.pin:
                continue
            if key == spare:
                kept.append((prio, stamp, key))
                continue
            take = min(entry.length - entry.pin, tokens - freed)
            if self.on_evict is not None:
                self.on_evict(key, entry.length, entry.priority)
            entry.length -= take
            freed += take
            if entry.length > entry.pin:
                kept.append((prio, stamp, key))  # keeps its place: it was not used, only trimmed
            elif entry.length == 0 and not entry.holders:
                del self._entries[key]
        for item in kept:
            heapq.heappush(self._order, item)
        self.tokens -= freed
        self.evictable -= freed
        return freed

    def demote(self, key: str) -> None:
        """Put ``key`` first in line for eviction (its trajectory has ended)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.priority = float("-inf")
            self._set(key, entry, entry.length, entry.pin)

    def evictable_below(self, tokens: int, priority: float, spare: str | None = None) -> int:
        """Evictable tokens of entries ranked at or below ``priority`` (other than ``spare``), counted up to
        ``tokens``: what a request of that priority may take without evicting anyone it outranks less."""
        if not self.by_priority:
            return self.evictable
        found = 0
        seen = []
        while found < tokens and self._order and self._order[0][0] <= priority:
            item = heapq.heappop(self._order)
            entry = self._entries.get(item[2])
            if entry is None or entry.stamp != item[1] or entry.length == entry.pin:
                continue  # stale, as ``evict`` would find it: dropped for good
            seen.append(item)
            if item[2] != spare:
                found += entry.length - entry.pin
        for item in seen:
            heapq.heappush(self._order, item)
        return found

    def _set(self, key: str, entry: _Entry, length: int, pin: int) -> None:
        self.tokens += length - entry.length
        self.evictable += (length - pin) - (entry.length - entry.pin)
        entry.length, entry.pin = length, pin
        if length == 0 and not entry.holders:
            del self._entries[key]
        entry.stamp = next(self._clock)  # used now: the most recent of its priority
        if length > pin:
            heapq.heappush(self._order, (entry.priority if self.by_priority else 0.0, entry.stamp, key))
        if len(self._order) > 4 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap items, which pile up as entries are touched and re-pushed."""
        self._order = [
            item
            for item in self._order
            if (e := self._entries.get(item[2])) is not None and e.stamp == item[1] and e.length > e.pin
        ]
        heapq.heapify(self._order)

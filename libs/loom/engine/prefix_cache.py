"""Prefix cache of the simulated engine: one cached length per ``prefix_key``, evicted LRU.

A key stands for one trajectory's growing context, so a radix tree reduces to a length per key. Running
requests pin the part of their key's entry they reuse; the tail beyond the longest pin and every
unpinned entry are evictable, tail first, as a radix cache evicts leaves first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Entry:
    length: int = 0
    pin: int = 0
    holders: dict[str, int] = field(default_factory=dict)  # rid -> tokens of this entry it reuses


class PrefixCache:
    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # Keys with evictable tokens, least recently used first: eviction never walks past pinned entries.
        self._lru: OrderedDict[str, None] = OrderedDict()
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

    def acquire(self, key: str, rid: str, cached: int) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
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

    def insert(self, key: str, length: int) -> None:
        """Make ``key`` hold at least ``length`` tokens (an imported prefix); the tail is evictable."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        self._set(key, entry, max(entry.length, length), entry.pin)

    def trim(self, key: str) -> None:
        """Drop what no running request reuses of ``key`` (an exported prefix that moved away)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._set(key, entry, entry.pin, entry.pin)

    def evict(self, tokens: int, spare: str | None = None) -> int:
        """Free up to ``tokens`` from least recently used entries other than ``spare``; return how many
        were freed."""
        freed = 0
        drained = []
        for key in self._lru:
            if freed >= tokens:
                break
            if key == spare:
                continue
            entry = self._entries[key]
            take = min(entry.length - entry.pin, tokens - freed)
            entry.length -= take
            freed += take
            if entry.length == entry.pin:
                drained.append(key)
        for key in drained:
            del self._lru[key]
            if self._entries[key].length == 0 and not self._entries[key].holders:
                del self._entries[key]
        self.tokens -= freed
        self.evictable -= freed
        return freed

    def _set(self, key: str, entry: _Entry, length: int, pin: int) -> None:
        self.tokens += length - entry.length
        self.evictable += (length - pin) - (entry.length - entry.pin)
        entry.length, entry.pin = length, pin
        if length == 0 and not entry.holders:
            del self._entries[key]
        if length > pin:
            self._lru[key] = None
            self._lru.move_to_end(key)
        else:
            self._lru.pop(key, None)

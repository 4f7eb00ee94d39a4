"""Per-request routing baselines: which worker serves a trajectory's next LLM call.

Each follows its source (read at the commits named; see the closing notes of issue 4):

- ``VerlSticky`` (verl ``AsyncLLMServerManager._choose_server``): the first request of a trajectory goes
  to the root of a heap of [assigned, index, server] over a shuffled server list, whose count then grows
  by one; later requests stick to it (LRU of 10,000 trajectories). Counts never go down: they count
  trajectories assigned, not requests in flight.
- ``LeastLoad`` (slime's router): every request goes to the worker with the fewest requests in flight
  (first on ties), the "least-loaded worker at each step" of the Heddle paper.
- ``CacheAware`` (sgl-router ``cache_aware``): if the router's in-flight counts are imbalanced,
  ``max - min > abs_threshold and max > min * rel_threshold`` (both strict), the least-loaded worker;
  otherwise the worker holding the longest prefix of the request when the match rate exceeds
  ``cache_threshold``, else the worker owning the least text in the router's tree. The request is then
  inserted under the chosen worker. ``verl_star()`` has the thresholds of the router verl* used
  (0.5, 32, 1.0001); ``sglang_default()`` today's defaults (0.3, 64, 1.5).

The router's tree is modelled per trajectory in tokens: a trajectory's requests extend each other, so a
worker's match is the longest request of that trajectory it was sent, capped at the current input.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RouterView:
    """What a routing policy may look at: live workers and the router's own in-flight counts."""

    workers: Sequence[str]
    inflight: Mapping[str, int]


class RoutingPolicy(Protocol):
    name: str

    def choose(self, traj: str, input_len: int, view: RouterView) -> str: ...

    def forget(self, traj: str) -> None: ...


def _least_loaded(view: RouterView) -> str:
    return min(view.workers, key=lambda w: view.inflight.get(w, 0))


class VerlSticky:
    name = "verl"

    def __init__(self, workers: Sequence[str], seed: int = 0, lru_size: int = 10_000) -> None:
        shuffled = list(workers)
        random.Random(seed).shuffle(shuffled)
        self._heap: list[tuple[int, int, str]] = [(0, i, w) for i, w in enumerate(shuffled)]
        heapq.heapify(self._heap)
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._lru_size = lru_size

    def choose(self, traj: str, input_len: int, view: RouterView) -> str:
        w = self._sticky.get(traj)
        if w is not None:
            self._sticky.move_to_end(traj)
            return w
        count, idx, w = self._heap[0]
        heapq.heapreplace(self._heap, (count + 1, idx, w))
        self._sticky[traj] = w
        if len(self._sticky) > self._lru_size:
            self._sticky.popitem(last=False)
        return w

    def forget(self, traj: str) -> None:
        """Nothing: verl keeps the LRU entry and the count."""


class LeastLoad:
    name = "slime"

    def choose(self, traj: str, input_len: int, view: RouterView) -> str:
        return _least_loaded(view)

    def forget(self, traj: str) -> None:
        """Stateless."""


@dataclass
class CacheAware:
    cache_threshold: float = 0.3
    abs_threshold: int = 64
    rel_threshold: float = 1.5
    name: str = "cache_aware"
    # traj -> worker -> longest request (tokens) of that trajectory inserted under the worker
    _tree: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    _owned: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # worker -> tokens in tree

    @classmethod
    def verl_star(cls) -> CacheAware:
        return cls(cache_threshold=0.5, abs_threshold=32, rel_threshold=1.0001, name="verl_star")

    @classmethod
    def sglang_default(cls) -> CacheAware:
        return cls(name="sglang_cache_aware")

    def imbalanced(self, view: RouterView) -> bool:
        loads = [view.inflight.get(w, 0) for w in view.workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold

    def choose(self, traj: str, input_len: int, view: RouterView) -> str:
        held = {w: n for w, n in self._tree[traj].items() if w in view.workers}
        if self.imbalanced(view):
            w = _least_loaded(view)
        else:
            best = max(held.items(), key=lambda kv: kv[1], default=None)
            match = min(best[1], input_len) / input_len if best and input_len else 0.0
            if best is not None and match > self.cache_threshold:
                w = best[0]
            else:
                w = min(view.workers, key=lambda x: self._owned.get(x, 0))
        self._insert(traj, w, input_len)
        return w

    def _insert(self, traj: str, worker: str, input_len: int) -> None:
        had = self._tree[traj].get(worker, 0)
        if input_len > had:
            self._owned[worker] += input_len - had
            self._tree[traj][worker] = input_len

    def forget(self, traj: str) -> None:
        """The router's tree keeps text until LRU eviction; a finished trajectory's share stays counted
        (``max_tree_size`` is 2^24+ characters, far above one rollout), but its per-trajectory entry
        can go since no request will match it again."""
        self._tree.pop(traj, None)


def make_routing(name: str, workers: Sequence[str], seed: int = 0) -> RoutingPolicy:
    if name == "verl":
        return VerlSticky(workers, seed=seed)
    if name == "slime":
        return LeastLoad()
    if name == "verl_star":
        return CacheAware.verl_star()
    if name == "sglang_cache_aware":
        return CacheAware.sglang_default()
    raise ValueError(f"unknown routing policy {name!r}")

"""Placement: which worker serves a trajectory."""

from __future__ import annotations

from collections.abc import Sequence


class RoundRobinPlacement:
    """Trajectory i of the plan goes to worker i mod m; late arrivals continue the rotation."""

    def __init__(self) -> None:
        self._next = 0

    def place(self, traj_ids: Sequence[str], workers: Sequence[str]) -> dict[str, str]:
        if not workers:
            raise ValueError("no workers to place on")
        ws = sorted(workers)
        out = {}
        for t in traj_ids:
            out[t] = ws[self._next % len(ws)]
            self._next += 1
        return out

    def place_one(self, traj_id: str, workers: Sequence[str], load: dict[str, int]) -> str:
        """A trajectory whose worker is gone: the least-loaded live worker (ties by name)."""
        if not workers:
            raise ValueError("no workers to place on")
        return min(sorted(workers), key=lambda w: load.get(w, 0))

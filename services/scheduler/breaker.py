"""A job's circuit breaker (``JobSpec.fail_fast``): when the first trajectories to finish all failed with one
cause, the rest would fail with it too (an environment that cannot start, a reward that cannot load), and a
100,000-trajectory job would learn it only at the end. Pure: it is told each trajectory as it finishes."""

from __future__ import annotations


class Breaker:
    def __init__(self, first: int) -> None:
        self.first = first  # how many trajectories to finish decide; 0: never
        # Of each of the first, the cause it failed with (None: it did not).
        self.causes: list[str | None] = []

    def see(self, status: str, cause: str) -> str | None:
        """One trajectory finished (in the order they finish): the cause, once the first ``first`` all failed
        with it; else None (and None for every trajectory after the first ``first``)."""
        if len(self.causes) >= self.first:
            return None
        self.causes.append(cause if status == "failed" and cause else None)
        if len(self.causes) < self.first:
            return None
        common = self.causes[0]
        return common if common is not None and all(c == common for c in self.causes) else None

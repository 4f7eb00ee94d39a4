"""Virtual-time driver: many ``SimCore``s and a workload's callbacks on one discrete-event clock.

The benchmark harness runs clusters of simulated engines and the trajectories on them (generate, tool call,
generate, ...) in seconds of wall time. Events are ordered by (time, order of scheduling), so a run is
deterministic. An engine's next event is recomputed lazily, once the events of an instant are done, because
a submission discards the core's planned run of iterations and many submissions often come at one instant.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.sim.core import SimCore

OnDone = Callable[[EngineOutput], None]

_CALL = -1  # engine index of plain callbacks in the event heap


class VirtualSim:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self.engines: list[SimCore] = []
        # (time, order, engine or _CALL, stamp, callback): an engine wake counts only if its stamp is current.
        self._events: list[tuple[float, int, int, int, Callable[[], None] | None]] = []
        self._order = itertools.count()
        self._stamps: list[int] = []
        self._dirty: list[int] = []
        self._is_dirty: list[bool] = []
        self._paused: list[bool] = []
        self._on_done: list[dict[str, OnDone]] = []

    def add_engine(self, core: SimCore) -> int:
        """Drive ``core`` on this clock from now on; return its index."""
        core.stall(self.now)
        self.engines.append(core)
        self._stamps.append(0)
        self._is_dirty.append(False)
        self._paused.append(False)
        self._on_done.append({})
        index = len(self.engines) - 1
        self._mark(index)
        return index

    def submit(self, engine: int, req: EngineRequest, on_done: OnDone) -> None:
        """Send ``req`` to ``engine`` now; ``on_done`` gets its output when it finishes or is aborted."""
        self.engines[engine].submit(req, self.now)
        self._on_done[engine][req.rid] = on_done
        self._mark(engine)

    def call_at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at virtual time ``t`` (now, if ``t`` has passed)."""
        heapq.heappush(self._events, (max(t, self.now), next(self._order), _CALL, 0, fn))

    def abort(self, engine: int, rid: str) -> bool:
        """Abort a request in flight on ``engine``; its ``on_done`` runs before this returns."""
        self._catch_up(engine)
        out = self.engines[engine].abort(rid, self.now)
        if out is None:
            return False
        self._mark(engine)
        self._on_done[engine].pop(rid)(out)
        return True

    def reprioritize(self, engine: int, rid: str, priority: float) -> bool:
        """Re-key a request waiting on ``engine`` (see ``SimCore.reprioritize``)."""
        self._catch_up(engine)
        if not self.engines[engine].reprioritize(rid, priority):
            return False
        self._mark(engine)
        return True

    def pause(self, engine: int) -> None:
        """Stop ``engine``'s iterations (its time stands still for its requests); submissions still queue."""
        self._catch_up(engine)
        self._paused[engine] = True
        self._mark(engine)

    def resume(self, engine: int) -> None:
        if self._paused[engine]:
            self.engines[engine].stall(self.now)
            self._paused[engine] = False
            self._mark(engine)

    def update_weights(self, engine: int, version: str) -> None:
        """Serve ``version`` on ``engine`` from now on: outputs finished before keep the old version, and the
        stale KV is flushed, the running requests recomputing their context (``SimCore.commit_weights``)."""
        self._catch_up(engine)
        self.engines[engine].commit_weights(version, self.now)
        self._mark(engine)

    def migrate_prefix(
        self,
        src: int,
        dst: int,
        prefix_key: str,
        keep_source: bool = False,
        bandwidth_gbps: float | None = None,
    ) -> float:
        """Move ``prefix_key``'s cached KV from ``src`` to ``dst``; return when it lands on ``dst``."""
        self._catch_up(src)
        tokens = self.engines[src].export_prefix(prefix_key, remove=not keep_source)
        return self.engines[dst].import_prefix(prefix_key, tokens, self.now, bandwidth_gbps)

    def end_prefix(self, engine: int, prefix_key: str) -> None:
        """Tell ``engine`` that ``prefix_key``'s trajectory has ended (its cache goes first)."""
        self._catch_up(engine)
        self.engines[engine].end_prefix(prefix_key)

    def run(self, until: float | None = None) -> None:
        """Process events in order until none is left or the next is after ``until``; then the clock reads
        ``until`` (if given)."""
        events = self._events
        while True:
            # Replan only once the instant is over, so that all the submissions of one instant meet in one
            # plan, as in an engine that batches whatever arrived since its last iteration.
            if self._dirty and (not events or events[0][0] > self.now):
                self._reschedule()
            if not events or (until is not None and events[0][0] > until):
                break
            t, _, engine, stamp, fn = heapq.heappop(events)
            if fn is not None:
                self.now = max(self.now, t)
                fn()
            elif stamp == self._stamps[engine]:
                self.now = max(self.now, t)
                self._deliver(engine, self.engines[engine].advance(self.now))
        if until is not None:
            self.now = max(self.now, until)

    def _mark(self, engine: int) -> None:
        if not self._is_dirty[engine]:
            self._is_dirty[engine] = True
            self._dirty.append(engine)

    def _reschedule(self) -> None:
        for engine in self._dirty:
            self._is_dirty[engine] = False
            self._stamps[engine] += 1
            if self._paused[engine]:
                continue
            t = self.engines[engine].next_event_time()
            if t is not None:
                heapq.heappush(self._events, (t, next(self._order), engine, self._stamps[engine], None))
        self._dirty.clear()

    def _catch_up(self, engine: int) -> None:
        if not self._paused[engine]:
            self._deliver(engine, self.engines[engine].advance(self.now))

    def _deliver(self, engine: int, outputs: list[EngineOutput]) -> None:
        self._mark(engine)
        on_done = self._on_done[engine]
        for out in outputs:
            on_done.pop(out.rid)(out)

"""Worker liveness: serving needs a fresh heartbeat; a fleet's weight update takes anyone heard from lately."""

from __future__ import annotations

from loom.protocol import WorkerInfo
from loom.runtime.workers import FLEET_MEMBER_S, LIVENESS_S, is_live


def _info(heartbeat_at: float) -> WorkerInfo:
    return WorkerInfo("w0", "qwen3-8b", "sim", "h100", 1, 64, 1000, 0.0, heartbeat_at)


def test_a_late_worker_is_off_the_routes_but_still_in_the_fleet() -> None:
    now = 1000.0
    late = _info(now - (LIVENESS_S + 4))
    assert not is_live(late, now) and is_live(late, now, FLEET_MEMBER_S)
    assert is_live(_info(now - 1), now)
    assert not is_live(_info(now - FLEET_MEMBER_S - 1), now, FLEET_MEMBER_S)

"""Rollout worker service: one per inference engine instance."""

from __future__ import annotations

from loom.engine import kinds
from loom.engine.base import Engine
from loom.runtime import service
from loom.runtime.service import Runtime
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker


def make_engine(rt: Runtime, s: RolloutSettings) -> Engine:
    return kinds.build(s, rt.clock, s.engine)


def build(rt: Runtime) -> RolloutWorker:
    s = rt.settings
    assert isinstance(s, RolloutSettings)
    return RolloutWorker(rt, s, make_engine(rt, s))


def main() -> None:
    service.main("rollout", RolloutSettings, build)


if __name__ == "__main__":
    main()

"""Scheduler service: REST API for jobs and the per-job control plane."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator
from typing import Any

import uvicorn

from loom import service
from loom.auth import Tokens
from loom.policies.rollmux.cluster import ClusterSpec
from loom.service import Runtime
from services.scheduler.api import build_app
from services.scheduler.dashboard import Dashboard
from services.scheduler.jobs import JobManager
from services.scheduler.rljobs import RLJobManager
from services.scheduler.settings import SchedulerSettings
from services.scheduler.streams import StreamManager

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The service runtime owns SIGTERM/SIGINT and stops uvicorn itself.
        yield


class Scheduler:
    def __init__(self, rt: Runtime, settings: SchedulerSettings) -> None:
        self.settings = settings
        # Refuse to start without tokens: an open API lets anyone read and cancel every tenant's jobs.
        self.tokens = Tokens.load(settings.api_token, settings.tokens_file)
        self.jobs = JobManager(rt, settings)
        cluster = ClusterSpec(
            roll_node_mem_gb=settings.rollmux_node_mem_gb,
            train_node_mem_gb=settings.rollmux_node_mem_gb,
            max_group_size=settings.rollmux_max_group,
            warm_start=settings.rollmux_warm_start,
        )
        self.rljobs = RLJobManager(rt, cluster, settings.rollmux_tail_threshold)
        self.streams = StreamManager(rt, settings, self.jobs.in_flight)
        self.jobs.streams_in_flight = self.streams.in_flight
        self.dashboard = Dashboard(rt, self.jobs, self.streams, self.rljobs)

    def health(self) -> dict[str, Any]:
        return {
            "api": f"http://{self.settings.host}:{self.settings.port}",
            **self.jobs.health(),
            **self.rljobs.health(),
            **self.streams.health(),
        }

    async def run(self, rt: Runtime) -> None:
        await self.jobs.start()
        await self.rljobs.start()
        await self.streams.start()
        await self.dashboard.start()
        app = build_app(rt, self.jobs, self.rljobs, self.streams, self.tokens, self.dashboard)
        server = _Server(
            uvicorn.Config(app, host=self.settings.host, port=self.settings.port, log_level="warning")
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(server.serve())
            tg.create_task(self.jobs.reconcile_forever())
            tg.create_task(self.streams.lease_forever())
            tg.create_task(self.dashboard.poll_reward_forever())
            await rt.stopping.wait()
            server.should_exit = True
        await self.streams.close()


def main() -> None:
    service.main("scheduler", SchedulerSettings, lambda rt: Scheduler(rt, rt.settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

"""Scheduler service: REST API for jobs and the per-job control plane."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Generator
from typing import Any

import uvicorn

from loom.identity.auth import Tokens
from loom.policies.rollmux.cluster import ClusterSpec
from loom.runtime import service
from loom.runtime.lease import Lease, LeaseLost, lease_bucket
from loom.runtime.service import Runtime
from services.scheduler.api import build_app
from services.scheduler.dashboard import Dashboard
from services.scheduler.jobs import JobManager
from services.scheduler.rljobs import RLJobManager
from services.scheduler.settings import SchedulerSettings
from services.scheduler.standby import Role, add_standby
from services.scheduler.streams import StreamManager

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, listening: Callable[[], None]) -> None:
        super().__init__(config)
        self.listening = listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # Its socket is bound and listening once this returns with ``started`` (a bind that fails exits).
        await super().startup(sockets)
        if self.started:
            self.listening()

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
        self.role: Role | None = None

    def health(self) -> dict[str, Any]:
        active = self.role.active if self.role is not None else False
        if not active:
            return {"api": self.settings.advertise_url(), "role": "standby"}
        return {
            "api": self.settings.advertise_url(),
            "role": "active",
            **self.jobs.health(),
            **self.rljobs.health(),
            **self.streams.health(),
        }

    async def run(self, rt: Runtime) -> None:
        """Serve the REST API at once; act as the scheduler once this instance holds the ``scheduler`` lease
        (``loom.runtime.lease``), and until then forward the API to the instance that does (``standby``). Every
        instance runs the same code: the one that starts first is active, the others take over when it dies,
        recovering jobs and streams from the bus as a restarted scheduler does. One that loses the lease
        stops (its supervisor restarts it as a standby): it must not act beside the new active one."""
        self.lease = Lease(await lease_bucket(rt.js), "scheduler", rt.instance, self.settings.advertise_url())
        self.role = Role(self._leader, hold_s=self.lease.ttl_s + 2.0)
        app = build_app(rt, self.jobs, self.rljobs, self.streams, self.tokens, self.dashboard)
        add_standby(app, self.role)
        server = _Server(
            uvicorn.Config(
                app,
                host=self.settings.host,
                port=self.settings.port,
                log_level="warning",
                # A stop closes the port at once and gives open answers (a dashboard's event stream) this long.
                timeout_graceful_shutdown=5,
            ),
            # Serving once the port listens, active or standing by (a standby forwards, and holds a request
            # until an active one answers): a readiness probe sends no client to a closed port.
            listening=rt.mark_ready,
        )
        lost: list[LeaseLost] = []
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(server.serve())
                if await self.lease.acquire(rt.stopping):
                    # Kept from the moment it is held: the reload reads through the streams' elections, which
                    # can outlast the lease's ttl, and a lease left to lapse meanwhile lets a standby take over
                    # beside this one.
                    tg.create_task(self._hold_lease(rt, lost))
                    await self.jobs.start()
                    await self.rljobs.start()
                    await self.streams.start()
                    await self.dashboard.start()
                    if not rt.stopping.is_set():
                        self.role.active = True
                        log.info("scheduler %s is active", rt.instance)
                        tg.create_task(self.jobs.reconcile_forever())
                        tg.create_task(self.streams.lease_forever())
                        tg.create_task(self.dashboard.poll_reward_forever())
                await rt.stopping.wait()
                server.should_exit = True
        finally:
            await self.role.close()
            await self.streams.close()
        if lost:
            log.error("scheduler %s stops: %s", rt.instance, lost[0])
            raise SystemExit(3)

    async def _hold_lease(self, rt: Runtime, lost: list[LeaseLost]) -> None:
        """Keep the lease. One that loses it stops acting at once, and the whole instance stops as on SIGTERM:
        its API closes its port rather than answer from what it last knew, with its bus connection gone (its
        supervisor restarts it as a standby)."""
        try:
            await self.lease.keep(rt.stopping)
        except LeaseLost as e:
            assert self.role is not None
            self.role.active = False
            # Another may act already: stop now, before the API's graceful shutdown and the drain.
            await rt.stop_handling()
            self.jobs.stop_acting()
            await self.streams.close()
            lost.append(e)
            rt.stopping.set()

    async def _leader(self) -> str | None:
        try:
            holder = await self.lease.holder()
        except (
            Exception
        ) as e:  # NATS failing over: no answer now; the standby holds the request and asks again
            log.debug("who holds the scheduler lease: %s", e)
            return None
        if holder is None or holder.nonce == self.lease.me.nonce:
            return None
        # A dead holder that served at this instance's own address (this process is its restart, on its port):
        # forwarding there would come back here; wait for its lease to lapse and a live one to take over.
        return None if holder.address == self.lease.me.address else holder.address


def main() -> None:
    service.main("scheduler", SchedulerSettings, lambda rt: Scheduler(rt, rt.settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

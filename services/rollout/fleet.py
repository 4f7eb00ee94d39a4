"""Many simulated rollout workers in one process: ``python -m services.rollout.fleet --count N --prefix wX``.

Each worker is the rollout service's own ``RolloutWorker`` on a ``SimEngine``, in a ``Runtime`` of its own
(worker id ``<prefix><i>``, instance ``<LOOM_INSTANCE>-<prefix><i>``, metrics, health), configured by the same
``LOOM_ROLLOUT_*`` environment as ``python -m services.rollout``. ``LOOM_ROLLOUT_SEED`` is the first worker's
seed; the others count on from it. By default every worker has its own NATS connection, as a worker process
would; ``--shared-connection`` runs them all over one (fewer sockets and reader tasks on the server and
here: with 256 workers idle, 0.08 cores instead of 0.14 for the fleet, about the same per call; ``loom bench
fleet --shared-connection``). The streams and buckets are made sure of once, not by every worker. SIGTERM or
SIGINT stops every worker: each drains its in-flight requests as the service does.

``loom bench fleet`` starts several such processes so that hundreds of workers fit on a few cores at a high
``LOOM_SPEED``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from loom import logs
from loom.runtime import bus
from loom.runtime.service import Runtime, serve
from services.rollout.__main__ import build
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)

# Workers that connect and register at once: enough to come up in seconds, few enough not to flood NATS.
CONNECT_CONCURRENCY = 16


class FleetRuntime(Runtime):
    """A worker's runtime in a fleet process: its own connection (or the fleet's shared one), the streams
    already ensured, and the fleet's stop event."""

    def __init__(
        self,
        settings: RolloutSettings,
        stopping: asyncio.Event,
        gate: asyncio.Semaphore,
        shared: tuple[NATS, JetStreamContext] | None = None,
    ) -> None:
        super().__init__("rollout", settings)
        self.stopping = stopping
        self._gate = gate
        self._shared = shared

    async def connect(self) -> None:
        if self._shared is not None:
            self._nc, self._js = self._shared
            return
        async with self._gate:
            self._nc = await bus.connect(
                self.settings.nats_url,
                f"loom-rollout-{self.instance}",
                credentials=self.settings.nats_credentials(),
            )
        self._js = self._nc.jetstream(timeout=10)

    async def drain(self) -> None:
        if self._shared is None:
            await super().drain()


def worker_settings(base: RolloutSettings, prefix: str, i: int) -> RolloutSettings:
    wid = f"{prefix}{i}"
    return base.model_copy(
        update={"worker_id": wid, "instance": f"{base.instance}-{wid}", "seed": base.seed + i}
    )


async def run_fleet(base: RolloutSettings, count: int, prefix: str, shared_connection: bool = False) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    first = await bus.connect(
        base.nats_url, f"loom-rollout-{base.instance}", credentials=base.nats_credentials()
    )
    js = first.jetstream(timeout=10)
    try:
        await bus.ensure_streams(js)
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)
        shared = (first, js) if shared_connection else None
        runtimes = [
            FleetRuntime(worker_settings(base, prefix, i), stopping, gate, shared) for i in range(count)
        ]
        log.info(
            "fleet %s: %d workers (pid %d, %s)",
            prefix,
            count,
            os.getpid(),
            "one shared connection" if shared_connection else "a connection each",
        )
        async with asyncio.TaskGroup() as tg:
            for rt in runtimes:
                tg.create_task(serve(rt, build, signals=False))
    finally:
        await _drain(first)


async def _drain(nc: NATS) -> None:
    if nc.is_closed:
        return
    try:
        await asyncio.wait_for(nc.drain(), timeout=10)
    except Exception as e:
        log.warning("drain failed: %s", e)
        await nc.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.rollout.fleet", description=__doc__)
    p.add_argument("--count", type=int, required=True, help="workers in this process")
    p.add_argument("--prefix", default="w", help="worker ids are <prefix><i>")
    p.add_argument("--shared-connection", action="store_true", help="one NATS connection for all workers")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be at least 1")
    base = RolloutSettings()
    if base.engine != "sim":
        p.error(f"a fleet process runs simulated engines only, not LOOM_ROLLOUT_ENGINE={base.engine}")
    logs.configure("rollout", base.log_level)
    asyncio.run(run_fleet(base, args.count, args.prefix, args.shared_connection))


if __name__ == "__main__":
    main(sys.argv[1:])

"""Health over NATS: ``gather`` asks every instance of every service (``loom status``, ``loom up``), and
``python3 -m loom.runtime.healthcheck`` is a container's healthcheck: exit 0 when a Loom service in this
container answers with ``ok`` (it is alive: a liveness probe), and with ``--ready`` when it also serves (compose's
healthcheck, a readiness probe: a rollout worker loading its model is alive but not ready). Instance names start
with the host name, which in a container is the container's own. Exit 1 otherwise, saying why on stderr."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time

from loom.protocol import DecodeError, Health, decode, subjects
from loom.runtime import bus
from loom.settings import LoomSettings


async def gather(
    nats_url: str, wait: float = 1.0, credentials: tuple[str, str] | None = None
) -> dict[str, list[Health]]:
    """Ask every instance of every service for its health; each instance answers the same inbox."""
    out: dict[str, list[Health]] = {s: [] for s in subjects.SERVICES}
    nc = await bus.connect(
        nats_url, "loom-health", max_reconnect_attempts=0, credentials=credentials, connect_timeout=3
    )
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        for s in subjects.SERVICES:
            await nc.publish(subjects.health(s), b"", reply=inbox)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            if not msg.data:  # the server's "no responders" status for a service not up yet
                continue
            try:
                h = decode(msg.data, Health)
            except DecodeError:
                continue
            out.setdefault(h.service, []).append(h)
    finally:
        await nc.close()
    return out


async def check(
    nats_url: str, host: str, credentials: tuple[str, str] | None = None, ready: bool = False
) -> str | None:
    """None when an instance on ``host`` is healthy (and, with ``ready``, serves), else what is wrong."""
    try:
        health = await gather(nats_url, 2.0, credentials)
    except Exception as e:
        return f"NATS at {nats_url.rsplit('@', 1)[-1]} does not answer: {e}"
    mine = [h for hs in health.values() for h in hs if h.instance.startswith(f"{host}-")]
    if any(h.ok and (h.ready or not ready) for h in mine):
        return None
    if any(h.ok for h in mine):
        return f"{mine[0].service} on {host} is alive but not serving yet"
    if mine:
        return f"{mine[0].service} on {host} reports unhealthy: {mine[0].details}"
    return f"no Loom service on {host} answered within 2 s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m loom.runtime.healthcheck", description=__doc__)
    parser.add_argument("--ready", action="store_true", help="healthy only once the service serves")
    args = parser.parse_args(argv)
    settings = LoomSettings()
    problem = asyncio.run(
        check(settings.nats_url, socket.gethostname(), settings.nats_credentials(), ready=args.ready)
    )
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

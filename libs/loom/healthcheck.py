"""``python3 -m loom.healthcheck``: a container's healthcheck (compose.yaml). Exit 0 when a Loom service in
this container answers its health request over NATS with ``ok``: instance names start with the host name,
which in a container is the container's own. Exit 1 otherwise, saying why on stderr."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import nats

from loom.protocol import Health, decode, subjects
from loom.settings import LoomSettings


async def check(nats_url: str, host: str, wait_s: float = 2.0) -> str | None:
    """None when an instance on ``host`` is healthy, else what is wrong."""
    try:
        nc = await nats.connect(nats_url, connect_timeout=3, max_reconnect_attempts=0)
    except Exception as e:
        return f"NATS at {nats_url.rsplit('@', 1)[-1]} does not answer: {e}"
    seen: list[Health] = []
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        for s in subjects.SERVICES:
            await nc.publish(subjects.health(s), b"", reply=inbox)
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            try:
                h = decode(msg.data, Health)
            except Exception:
                continue  # "no responders" for a service with no instance up, or a stranger's reply
            if h.instance.startswith(f"{host}-"):
                if h.ok:
                    return None
                seen.append(h)
    finally:
        await nc.close()
    if seen:
        return f"{seen[0].service} on {host} reports unhealthy: {seen[0].details}"
    return f"no Loom service on {host} answered within {wait_s:.0f} s"


def main() -> int:
    problem = asyncio.run(check(LoomSettings().nats_url, socket.gethostname()))
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

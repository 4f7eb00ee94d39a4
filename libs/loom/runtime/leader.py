"""Asking the active instance of a leased service (the scheduler: ``loom.runtime.lease``) through a takeover.

From the active instance's end until its successor serves, nobody answers the service's subjects (no
responders), and a request that reaches it while a stream elects a leader is answered ``FAILOVER``. Either
way the request did nothing, so asking again is safe, even for a request that is not idempotent; every
client of the scheduler over NATS (the trainer SDK, the co-scheduling shim) asks through here.

A request that gets no answer in time may have been done: the active instance died holding it (killed with
-9 mid-request), or the client's nats-server died with the request or its answer on the wire. Only an
idempotent request (a read, a lease renewal, a report counted once) is asked again after that.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from loom.runtime import bus
from loom.runtime.lease import lease_ttl

T = TypeVar("T")


def takeover_s() -> float:
    """How long a takeover may leave a service's subjects unanswered: the dead holder's lease lapses (its
    ttl), the successor creates it through the lease bucket's election, then reloads, reading and
    republishing through the streams' elections for up to ``FAILOVER_S`` before it serves. (A local HA run's
    reload took 21 s through a nats-server's death; a trainer that waited 2 * ttl + 2 = 14 s gave up in CI.)"""
    return 2 * lease_ttl() + bus.FAILOVER_S


async def ask_active(
    nc: NATS,
    subject: str,
    payload: Any,
    reply_type: type[T],
    timeout_s: float = 5.0,
    *,
    idempotent: bool = False,
) -> T:
    """``bus.request``, waiting out a service that is not there yet (starting, or taken over) for up to
    ``takeover_s`` and a bus that fails over for up to ``FAILOVER_S``, whatever ``timeout_s``; an
    ``idempotent`` request unanswered within ``timeout_s`` is asked again for up to ``takeover_s`` too."""
    start = time.monotonic()
    takeover_until = start + max(timeout_s, takeover_s())
    failover_until = start + max(timeout_s, bus.FAILOVER_S)
    while True:
        try:
            return await bus.request(nc, subject, payload, reply_type, timeout_s=timeout_s)
        except NoRespondersError:
            if time.monotonic() >= takeover_until:
                raise
        except NatsTimeoutError:
            if not idempotent or time.monotonic() >= takeover_until:
                raise
        except bus.BusError as e:
            if e.code != bus.FAILOVER or time.monotonic() >= failover_until:
                raise
        await asyncio.sleep(0.2)

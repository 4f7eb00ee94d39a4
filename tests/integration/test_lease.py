"""The key-value lease one active scheduler (or router) holds: never two holders, a dead holder's lease passes
within its ttl, a clean release at once, and a holder that lost it finds out at its next renewal."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from loom.runtime import bus
from loom.runtime.bus import ensure_kv
from loom.runtime.lease import Lease, LeaseLost
from loom.runtime.natsserver import NatsServer

TTL = 1.5


async def _bucket(nc: NATS, name: str):  # type: ignore[no-untyped-def]
    return await ensure_kv(nc.jetstream(), name, ttl=TTL, replicas=1)


async def test_one_holder_at_a_time_and_takeover_within_the_ttl(nc: NATS) -> None:
    kv = await _bucket(nc, "lease_a")
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    a, b = Lease(kv, "scheduler", "a", "http://a", TTL), Lease(kv, "scheduler", "b", "http://b", TTL)
    assert await a.acquire(stop_a)
    keeping = asyncio.create_task(a.keep(stop_a))
    waiting = asyncio.create_task(b.acquire(stop_b, poll_s=0.1))
    await asyncio.sleep(3 * TTL)  # a renews all along: b never gets it
    assert not waiting.done() and (await b.holder()) == a.me
    # a dies without a word: b holds the lease within the ttl of a's last renewal (plus a poll).
    keeping.cancel()
    died = time.monotonic()
    assert await asyncio.wait_for(waiting, 3 * TTL)
    assert time.monotonic() - died < TTL + 1.0
    assert (await a.holder()) == b.me and (await a.holder()).address == "http://b"  # type: ignore[union-attr]
    # a, back from the dead, finds out at its next renewal and stops acting.
    with pytest.raises(LeaseLost, match="taken by b"):
        await a.renew()
    assert not a.held
    # A clean stop releases at once: the next standby takes it at its first poll.
    c = Lease(kv, "scheduler", "c", "", TTL)
    waiting = asyncio.create_task(c.acquire(asyncio.Event(), poll_s=0.05))
    stop_b.set()
    await b.keep(stop_b)
    released = time.monotonic()
    assert await asyncio.wait_for(waiting, TTL)
    assert time.monotonic() - released < TTL / 2


async def test_a_renewal_whose_reply_was_lost_still_holds(nc: NATS) -> None:
    kv = await _bucket(nc, "lease_b")
    a = Lease(kv, "router", "a", ttl_s=TTL)
    assert await a.try_acquire()
    assert a.revision is not None
    # The update landed but its reply never came back: a still believes the older revision.
    a.revision = await kv.update("router", (await kv.get("router")).value or b"", last=a.revision) - 1
    await a.renew()
    assert a.held and (await a.holder()) == a.me


async def test_a_lease_that_lapsed_unclaimed_is_taken_again(nc: NATS) -> None:
    """A holder too busy to renew within the ttl, with no standby to take over, keeps acting: it takes the
    lapsed lease again at its next renewal (no one else acted meanwhile)."""
    kv = await _bucket(nc, "lease_c")
    a = Lease(kv, "scheduler", "a", ttl_s=TTL)
    assert await a.try_acquire()
    await asyncio.sleep(TTL + 1.5)  # lapsed
    assert (await a.holder()) is None
    await a.renew()
    assert a.held and (await a.holder()) == a.me
    # Lapsed and taken by another meanwhile: lost.
    await asyncio.sleep(TTL + 1.5)
    b = Lease(kv, "scheduler", "b", ttl_s=TTL)
    assert await b.try_acquire()
    with pytest.raises(LeaseLost, match="taken by b"):
        await a.renew()


async def test_a_holder_whose_renewals_go_unanswered_stops_within_the_ttl(tmp_path: Path) -> None:
    """The entry lapses ``ttl`` after the server stored the last renewal, and a standby may create it then: the
    holder must know it lost the lease by that time, not when its unanswered renewal times out (5 s later, as
    nats-py's JetStream requests do), which left two active schedulers in the HA e2e test."""
    server = NatsServer(tmp_path / "nats")
    nc = await bus.connect(await server.start(), "t")
    try:
        kv = await _bucket(nc, "lease_d")
        a = Lease(kv, "scheduler", "a", ttl_s=TTL)
        assert await a.acquire(asyncio.Event())
        keeping = asyncio.create_task(a.keep(asyncio.Event()))
        await asyncio.sleep(TTL)
        await server.stop()  # every renewal from now on waits for an answer that never comes
        gone = time.monotonic()
        with pytest.raises(LeaseLost, match="could not be renewed"):
            await asyncio.wait_for(keeping, 10)
        assert time.monotonic() - gone < TTL + 0.2
        assert not a.held
    finally:
        with contextlib.suppress(OSError):  # its server is gone
            await nc.close()
        await server.stop()


async def test_a_holder_whose_store_failed_stops_at_the_lapse_not_a_timeout_later(nc: NATS) -> None:
    """Renewals that fail at once (the lease's stream has no leader) and then one that goes unanswered at the
    lapse: the holder stops acting at the lapse. It used to ask once more without a deadline and wait out
    nats-py's 5 s timeout, while a standby had taken over: the HA e2e test's logs showed both schedulers
    completing the same job."""
    kv = await _bucket(nc, "lease_e")
    a = Lease(kv, "scheduler", "a", ttl_s=TTL)
    assert await a.try_acquire()
    taken = time.monotonic()
    await nc.jetstream().delete_stream("KV_lease_e")  # no stream: every renewal fails at once
    await a.renew()
    assert a.held
    await asyncio.sleep(taken + TTL + 0.05 - time.monotonic())
    await nc.subscribe("$KV.lease_e.>")  # now a renewal is taken by someone who never answers
    asked = time.monotonic()
    with pytest.raises(LeaseLost, match="could not be renewed"):
        await a.renew()
    assert time.monotonic() - asked < 0.5
    assert not a.held

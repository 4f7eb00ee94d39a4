"""Leadership through a JetStream key-value lease: one active instance of a service, the others standing by.

The lease is one key of a bucket whose entries expire ``ttl_s`` after their last write (the bucket's
``max_age``). An instance takes it by creating the key (a create succeeds only where there is none, or only
a deletion marker), and keeps it by updating it every ``ttl_s / 4`` against the revision it last wrote, so
that no two instances ever both believe they hold it: an update after someone else's create fails on the
revision. An active instance that cannot renew for ``ttl_s`` (its NATS is gone, or another took the key)
has lost it and must stop acting at once; a standby's create succeeds within ``ttl_s`` of the active one's
last renewal, plus one poll. A clean stop deletes the key, so the standby takes over at its next poll.

The record names the holder and where it serves (a scheduler's REST address), for standbys to forward to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable

import msgspec
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from loom.protocol import subjects
from loom.runtime.bus import ensure_kv

log = logging.getLogger(__name__)


def lease_ttl() -> float:
    """How long a lease outlives its holder's last renewal (``LOOM_LEASE_TTL_S``, 6 s): a standby takes over
    within about this long of the active instance's death."""
    ttl = float(os.environ.get("LOOM_LEASE_TTL_S", "6"))
    if not 1.0 <= ttl <= 60.0:
        raise ValueError(f"LOOM_LEASE_TTL_S must lie between 1 and 60 seconds, not {ttl:g}")
    return ttl


async def lease_bucket(js: JetStreamContext) -> KeyValue:
    """The bucket of every service's lease, its entries expiring ``lease_ttl()`` after their last write."""
    return await ensure_kv(js, subjects.KV_LEASES, ttl=lease_ttl())


class LeaseLost(Exception):
    """The lease was taken by another instance, or could not be renewed within its ttl."""


class Holder(msgspec.Struct, frozen=True):
    instance: str
    address: str
    # Unique per acquisition: an instance that restarts under the same name is a different holder.
    nonce: str
    since: float


class Lease:
    def __init__(
        self, kv: KeyValue, key: str, instance: str, address: str = "", ttl_s: float | None = None
    ) -> None:
        self.kv = kv
        self.key = key
        self.ttl_s = lease_ttl() if ttl_s is None else ttl_s
        self.me = Holder(instance, address, uuid.uuid4().hex, time.time())
        self.revision: int | None = None
        self._renewed = 0.0
        # The last renewal failed: the lease lapses at ``_renewed + ttl_s`` unless one lands before.
        self._failing = False

    @property
    def held(self) -> bool:
        return self.revision is not None

    async def holder(self) -> Holder | None:
        """Who holds the lease now (None: no one)."""
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return msgspec.json.decode(entry.value, type=Holder)
        except msgspec.DecodeError:
            return None

    async def try_acquire(self) -> bool:
        sent = time.monotonic()
        try:
            self.revision = await self.kv.create(self.key, msgspec.json.encode(self.me))
        except KeyWrongLastSequenceError:
            return False
        self._renewed, self._failing = sent, False
        log.info("lease %s taken by %s", self.key, self.me.instance)
        return True

    async def acquire(
        self, stopping: asyncio.Event, poll_s: float = 0.5, standing_by: Callable[[], None] | None = None
    ) -> bool:
        """Wait until this instance holds the lease (True) or ``stopping`` is set (False). NATS errors while
        waiting are waited out: a standby outlives a server's restart. ``standing_by`` is called once, when
        another instance is found holding it (this one stands by, which is what it then serves as)."""
        while not stopping.is_set():
            try:
                if await self.try_acquire():
                    return True
                if standing_by is not None:
                    standing_by()
                    standing_by = None
            except (TimeoutError, OSError, KeyNotFoundError) as e:
                log.debug("lease %s: %s", self.key, e)
            except Exception as e:  # nats errors have no common base worth naming; keep standing by
                log.warning("lease %s: %s: %s", self.key, type(e).__name__, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), poll_s)
        return False

    async def renew(self) -> None:
        """One renewal; LeaseLost when another holds it or the last good renewal is ``ttl_s`` old."""
        if self.revision is None:
            raise LeaseLost(f"lease {self.key} is not held")
        # The entry's ttl runs from when the server stored the write, which is after it was sent: the lease is
        # held until ``ttl_s`` after the last renewal that was *sent* and landed, and not a moment longer. A
        # renewal left waiting for its answer past that (its stream electing a leader) found out only when the
        # request timed out, while a standby had taken over seconds before: two active schedulers.
        # (One that renews past it, its loop too busy to renew in time, asks all the same: the answer says
        # whether another took it or it lapsed unclaimed.)
        sent = time.monotonic()
        left = self._renewed + self.ttl_s - sent
        if left <= 0 and self._failing:
            # Lapsed because the store did not answer (its stream electing a leader), not because this instance
            # was too busy to ask: a standby may hold it already. Asking now waited out nats-py's timeout (5 s)
            # while acting, and the HA e2e test logged two active schedulers completing the same job.
            self.revision = None
            raise LeaseLost(f"lease {self.key} could not be renewed for {self.ttl_s:g} s")
        try:
            # One too busy to renew in time asks only briefly: the answer says whether it lapsed unclaimed.
            async with asyncio.timeout(left if left > 0 else self.ttl_s / 4):
                rev = await self.kv.update(self.key, msgspec.json.encode(self.me), last=self.revision)
            self.revision, self._renewed, self._failing = rev, sent, False
            return
        except KeyWrongLastSequenceError:
            # A renewal whose reply was lost still counts: the entry then carries our nonce. When it was sent is
            # not known, so it is renewed again from the revision it made.
            current = await self._entry()
            if current is not None and current[0] == self.me:
                self.revision = current[1]
                return await self.renew()
            # Lapsed with no one taking it (this instance was too busy to renew in time): no one else acted,
            # so taking it again is safe; if another takes it first, the create fails and the lease is lost.
            if current is None and await self.try_acquire():
                log.warning("lease %s lapsed unclaimed; %s holds it again", self.key, self.me.instance)
                return
            self.revision = None
            raise LeaseLost(
                f"lease {self.key} was taken by {current[0].instance if current else 'no one'}"
            ) from None
        except LeaseLost:
            raise
        except Exception as e:
            if time.monotonic() - self._renewed < self.ttl_s:
                log.warning("lease %s: renewal failed (%s: %s); retrying", self.key, type(e).__name__, e)
                self._failing = True
                return
            self.revision = None
            raise LeaseLost(f"lease {self.key} could not be renewed for {self.ttl_s:g} s: {e}") from e

    async def keep(self, stopping: asyncio.Event) -> None:
        """Renew until ``stopping`` is set (then release) or the lease is lost (LeaseLost)."""
        while True:
            try:
                await asyncio.wait_for(stopping.wait(), self.ttl_s / 4)
            except TimeoutError:
                await self.renew()
                continue
            await self.release()
            return

    async def release(self) -> None:
        if self.revision is None:
            return
        try:
            await self.kv.delete(self.key, last=self.revision)
        except Exception as e:  # expired or taken already, or NATS is gone: it lapses on its own
            log.debug("lease %s: release: %s", self.key, e)
        self.revision = None

    async def _entry(self) -> tuple[Holder, int] | None:
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return None
        if not entry.value or entry.revision is None:
            return None
        try:
            return msgspec.json.decode(entry.value, type=Holder), entry.revision
        except msgspec.DecodeError:
            return None

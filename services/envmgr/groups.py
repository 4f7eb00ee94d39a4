"""Which samples a group keeps when it was started with redundant ones (RollArt's redundant rollouts).

One KV entry per group lists the trajectories kept so far; a finishing sample claims a place with a
compare-and-set, so that across any number of managers exactly ``group_size`` samples are kept. Every read is
done again while the bucket's stream elects a leader (a nats-server died): a running trajectory fails on none.
"""

from __future__ import annotations

import json

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from loom.protocol import TrajWork, subjects
from loom.runtime.bus import JS_ELECTING, kv_key, through_failover


class GroupLedger:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def _read(self, key: str) -> tuple[list[str], int | None]:
        try:
            e = await through_failover(lambda: self.kv.get(key))
        except KeyNotFoundError:
            return [], None
        return (json.loads(e.value) if e.value else []), e.revision

    async def full(self, w: TrajWork) -> bool:
        kept, _ = await self._read(kv_key(w.job_id, str(w.group)))
        return len(kept) >= w.group_size and w.traj_id not in kept

    async def restarted(self, w: TrajWork) -> bool:
        """Whether the scheduler gave the stream's group up (the bound aborted it): its samples not yet begun
        never run."""
        try:
            await through_failover(lambda: self.kv.get(subjects.group_restarted_key(w.job_id, w.group)))
        except KeyNotFoundError:
            return False
        return True

    async def claim(self, w: TrajWork) -> list[str] | None:
        """The group's kept samples with this one among them, or None if the group was already full."""
        key = kv_key(w.job_id, str(w.group))
        while True:
            kept, rev = await self._read(key)
            if w.traj_id in kept:
                return kept  # a redelivered trajectory that had claimed its place
            if len(kept) >= w.group_size:
                return None
            new = [*kept, w.traj_id]
            data = json.dumps(new).encode()
            try:
                if rev is None:
                    await self.kv.create(key, data)
                else:
                    await self.kv.update(key, data, last=rev)
                return new
            except KeyWrongLastSequenceError:
                continue  # another sample claimed first: read again
            except JS_ELECTING:
                continue  # the write may have landed: the next read tells

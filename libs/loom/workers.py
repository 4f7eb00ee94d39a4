"""The worker registry (KV ``loom_workers``): rollout workers heartbeat their ``WorkerInfo`` into it."""

from __future__ import annotations

import time

from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue

from loom.protocol import DecodeError, WorkerInfo, decode

# A worker is live while its last heartbeat is younger than this (wall seconds).
LIVENESS_S = 6.0
# A fleet's weight update includes every worker heard from within this window: a worker whose heartbeats are
# late (its host busy loading weights and training on the same cores) but still serving must move with the
# fleet, or it would keep the old weights; one that is really gone fails the pause, and the update with it.
FLEET_MEMBER_S = 30.0


def is_live(info: WorkerInfo, now: float | None = None, within_s: float = LIVENESS_S) -> bool:
    return ((now if now is not None else time.time()) - info.heartbeat_at) < within_s


async def read_workers(
    kv: KeyValue, live_only: bool = True, within_s: float = LIVENESS_S
) -> dict[str, WorkerInfo]:
    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    out: dict[str, WorkerInfo] = {}
    now = time.time()
    for k in keys:
        try:
            entry = await kv.get(k)
        except KeyNotFoundError:
            continue
        if not entry.value:
            continue
        try:
            info = decode(entry.value, WorkerInfo)
        except DecodeError:
            continue
        if not live_only or is_live(info, now, within_s):
            out[info.worker_id] = info
    return out

"""Redundant rollouts' group ledger on a real JetStream KV: exactly group_size samples are kept."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS

from loom.protocol import TaskSpec, ToolLatency, TrajWork, subjects
from services.envmgr.groups import GroupLedger


def _work(traj: str, group: int = 0) -> TrajWork:
    return TrajWork(
        "job-g",
        traj,
        TaskSpec(id="t"),
        group,
        0,
        "code",
        "m",
        10,
        100,
        ToolLatency(),
        group_size=2,
        redundancy=3,
    )


async def test_concurrent_claims_keep_exactly_group_size(nc: NATS) -> None:
    ledger = GroupLedger(await nc.jetstream().key_value(subjects.KV_GROUPS))
    works = [_work(f"t-{i}") for i in range(5)]
    results = await asyncio.gather(*(ledger.claim(w) for w in works))
    kept = [w.traj_id for w, r in zip(works, results, strict=True) if r is not None]
    assert len(kept) == 2
    final = max((r for r in results if r is not None), key=len)
    assert sorted(final) == sorted(kept)
    # A redelivered winner keeps its place; a loser stays out; other groups are independent.
    assert await ledger.claim(works[[w.traj_id for w in works].index(kept[0])]) == final
    loser = next(w for w in works if w.traj_id not in kept)
    assert await ledger.claim(loser) is None and await ledger.full(loser)
    assert await ledger.claim(_work("t-0", group=1)) == ["t-0"]

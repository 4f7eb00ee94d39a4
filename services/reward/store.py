"""Storing a scored trajectory: the result stream (idempotent by job and trajectory), its KV state, and the
TrajDone event. Workers store what they score; the controller stores, unscored, what could not be."""

from __future__ import annotations

import msgspec
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from loom.protocol import TrajDone, Trajectory, TrajMeta, TrajState, encode, subjects
from loom.runtime import results
from loom.runtime.bus import kv_key, through_failover


async def store(
    js: JetStreamContext, kv_traj: KeyValue, nc: NATS, traj: Trajectory, reward: float | None
) -> bool:
    """Store ``traj`` with ``reward``; returns False when it had been stored before (a redelivery)."""
    traj = msgspec.structs.replace(traj, reward=reward)
    # Both writes may be asked again while their stream elects a leader: the result carries its message id (the
    # stream keeps one), the state is a whole record. Failing here instead spent the request's deliveries, and
    # past the last one the trajectory was stored without its reward.
    stored = await through_failover(lambda: results.publish_result(js, traj))
    state: TrajState = "done" if traj.status == "completed" else "failed"
    meta = encode(TrajMeta(traj.job_id, traj.traj_id, state=state))
    await through_failover(lambda: kv_traj.put(kv_key(traj.job_id, traj.traj_id), meta))
    ev = TrajDone(
        traj.job_id,
        traj.traj_id,
        traj.status,
        reward,
        traj.output_tokens,
        len(traj.steps),
        traj.task_id,
        traj.group,
        "" if traj.status == "completed" else results.cause(traj.finish_reason),
    )
    await nc.publish(subjects.traj_done(traj.job_id), encode(ev))
    return stored

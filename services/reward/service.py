"""Reward service: scores trajectories from the durable reward queue and stores them as results.

The result is stored (idempotently, by trajectory) before the request is acknowledged, so a worker that
dies mid-request causes a redelivery, never a loss or a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
from nats.aio.msg import Msg

from loom import results
from loom.bus import kv_key
from loom.protocol import DecodeError, RewardRequest, TrajDone, TrajMeta, TrajState, decode, encode, subjects
from loom.service import Runtime
from loom.workqueue import WorkQueueConsumer
from services.reward.scorer import score
from services.reward.settings import RewardSettings

log = logging.getLogger(__name__)

DURABLE = "reward"


class RewardService:
    def __init__(self, rt: Runtime, settings: RewardSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.consumer: WorkQueueConsumer | None = None
        m = rt.metrics
        self.m_scored = m.counter("scored_total", "Trajectories scored and stored", ["status"])
        self.m_dupes = m.counter("duplicates_total", "Results already stored (redeliveries)")
        self.m_errors = m.counter("errors_total", "Scoring attempts that failed")
        self.m_latency = m.histogram("score_seconds", "Time to score and store one trajectory (wall)")

    def health(self) -> dict[str, Any]:
        return {"inflight": len(self.consumer.tasks) if self.consumer is not None else 0}

    async def run(self, rt: Runtime) -> None:
        self.kv_traj = await rt.js.key_value(subjects.KV_TRAJ)
        self.consumer = WorkQueueConsumer(
            rt,
            stream=subjects.STREAM_REWARD,
            subject=subjects.STREAM_REWARD_SUBJECTS[0],
            durable=DURABLE,
            ack_wait_s=self.settings.ack_wait_s,
            capacity=self.settings.concurrency,
            handler=self._handle,
            batch=32,
        )
        await self.consumer.run()
        await self.consumer.finish(10)

    async def _handle(self, m: Msg) -> None:
        with self.m_latency.time():
            try:
                req = decode(m.data, RewardRequest)
            except DecodeError as e:
                await self.rt.dead_letter(m.subject, f"bad reward request: {e}", m.data)
                await m.term()
                return
            traj = req.trajectory
            try:
                reward = await asyncio.to_thread(score, req)
                traj = msgspec.structs.replace(traj, reward=reward)
                stored = await results.publish_result(self.rt.js, traj)
                if not stored:
                    self.m_dupes.inc()
                key = kv_key(traj.job_id, traj.traj_id)
                state: TrajState = "done" if traj.status == "completed" else "failed"
                await self.kv_traj.put(key, encode(TrajMeta(traj.job_id, traj.traj_id, state=state)))
                ev = TrajDone(
                    traj.job_id,
                    traj.traj_id,
                    traj.status,
                    reward,
                    traj.output_tokens,
                    len(traj.steps),
                    traj.task_id,
                )
                await self.rt.nc.publish(subjects.traj_done(traj.job_id), encode(ev))
                await m.ack()
                self.m_scored.labels(traj.status).inc()
            except Exception as e:
                self.m_errors.inc()
                delivered = m.metadata.num_delivered
                log.warning("scoring %s failed (delivery %d): %s", traj.traj_id, delivered, e)
                if delivered >= self.settings.max_deliver:
                    await self.rt.dead_letter(m.subject, f"scoring failed {delivered} times: {e}", m.data)
                    await m.term()
                else:
                    with contextlib.suppress(Exception):
                        await m.nak(delay=min(2.0**delivered, 30.0))

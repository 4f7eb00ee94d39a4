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
from nats.js.api import AckPolicy, ConsumerConfig

from loom import results
from loom.bus import kv_key
from loom.protocol import DecodeError, RewardRequest, TrajDone, TrajMeta, TrajState, decode, encode, subjects
from loom.service import Runtime
from services.reward.scorer import score
from services.reward.settings import RewardSettings

log = logging.getLogger(__name__)

DURABLE = "reward"


class RewardService:
    def __init__(self, rt: Runtime, settings: RewardSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.inflight: set[asyncio.Task[None]] = set()
        m = rt.metrics
        self.m_scored = m.counter("scored_total", "Trajectories scored and stored", ["status"])
        self.m_dupes = m.counter("duplicates_total", "Results already stored (redeliveries)")
        self.m_errors = m.counter("errors_total", "Scoring attempts that failed")
        self.m_latency = m.histogram("score_seconds", "Time to score and store one trajectory (wall)")

    def health(self) -> dict[str, Any]:
        return {"inflight": len(self.inflight)}

    async def run(self, rt: Runtime) -> None:
        self.kv_traj = await rt.js.key_value(subjects.KV_TRAJ)
        cfg = ConsumerConfig(
            durable_name=DURABLE,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=-1,
        )
        psub = await rt.js.pull_subscribe(
            subjects.STREAM_REWARD_SUBJECTS[0], durable=DURABLE, stream=subjects.STREAM_REWARD, config=cfg
        )
        while not rt.stopping.is_set():
            free = self.settings.concurrency - len(self.inflight)
            if free <= 0:
                await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                msgs = await psub.fetch(min(free, 32), timeout=1.0)
            except TimeoutError:
                continue
            except Exception as e:
                log.warning("fetch failed: %s", e)
                await asyncio.sleep(0.5)
                continue
            for m in msgs:
                t = asyncio.create_task(self._handle(m))
                self.inflight.add(t)
                t.add_done_callback(self.inflight.discard)
        if self.inflight:
            await asyncio.wait(self.inflight, timeout=10)
        # A pull subscription never drains (fetch leaves status messages queued): drop it before drain.
        await psub.unsubscribe()

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

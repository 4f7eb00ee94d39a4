"""Taking batches from a rollout stream's sample buffer (JetStream ``LOOM_SAMPLES``).

One durable consumer per stream (``trainer-<stream>``) hands each finished group to one trainer: the trainer
SDK and the scheduler's REST edge both take batches through ``SampleBuffer``. Groups the asynchronous bound no
longer admits are dropped here and reported, so the stream samples their tasks again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from loom.policies.staleness import AsyncBound
from loom.protocol import BatchTaken, DecodeError, SampleGroup, Stream, Trajectory, decode, subjects
from loom.runtime import bus

log = logging.getLogger(__name__)


class StreamClosed(RuntimeError):
    """The stream was cancelled or failed: no batch will come."""


class StreamEnded(StopAsyncIteration):
    """The stream went through all its epochs and every group was taken."""


@dataclass
class Group:
    """One GRPO group: the samples of one task, finished, with the version that started the oldest."""

    stream_id: str
    group: int
    task_id: str
    start_version: int
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


@dataclass
class Batch:
    groups: list[Group]
    # The policy version the batch was taken at, and how many buffered groups the bound dropped.
    version: int
    stale: int = 0
    waited_s: float = 0.0
    staleness: list[int] = field(default_factory=list)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


def consumer_name(stream_id: str) -> str:
    return f"trainer-{stream_id}"


class SampleBuffer:
    def __init__(
        self,
        js: JetStreamContext,
        stream_id: str,
        read_stream: Callable[[], Awaitable[Stream]],
        report: Callable[[BatchTaken], Awaitable[object]],
    ) -> None:
        self.js = js
        self.stream_id = stream_id
        self.read_stream = read_stream
        self.report = report
        self._sub: Any = None

    async def _subscription(self) -> Any:
        if self._sub is None:
            cfg = ConsumerConfig(
                durable_name=consumer_name(self.stream_id),
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.EXPLICIT,
                # A trainer that dies holding groups hands them to the next one after this long.
                ack_wait=120.0,
                max_ack_pending=100_000,
            )
            self._sub = await bus.through_failover(
                lambda: self.js.pull_subscribe(
                    subjects.samples(self.stream_id),
                    durable=cfg.durable_name,
                    stream=subjects.STREAM_SAMPLES,
                    config=cfg,
                )
            )
        return self._sub

    async def _live(self) -> Stream:
        st = await self.read_stream()
        if st.state in ("cancelled", "failed"):
            raise StreamClosed(f"stream {st.id} is {st.state}" + (f": {st.error}" if st.error else ""))
        return st

    async def take(self, n_groups: int, timeout_s: float | None = None) -> Batch:
        """Block until ``n_groups`` complete groups within the bound are in the buffer, and take them.

        TimeoutError after ``timeout_s`` (the groups seen so far go back to the buffer); StreamClosed on a
        cancelled stream; at the end of a finite stream a smaller last batch, then StreamEnded."""
        if n_groups < 1:
            raise ValueError("n_groups must be at least 1")
        t0 = time.monotonic()
        st = await self._live()
        bound = AsyncBound(st.spec.async_bound)
        sub = await self._subscription()
        got: list[tuple[Msg, SampleGroup]] = []
        stale: list[tuple[Msg, SampleGroup]] = []
        dropped = 0  # stale groups reported while waiting
        while len(got) < n_groups:
            left = None if timeout_s is None else timeout_s - (time.monotonic() - t0)
            if left is not None and left <= 0:
                await _nak(got)
                raise TimeoutError(f"{len(got)} of {n_groups} groups ready after {timeout_s:.0f} s")
            try:
                msgs = await sub.fetch(n_groups - len(got), timeout=min(1.0, left) if left else 1.0)
            except (*bus.JS_FAILING_OVER, NoRespondersError) as e:  # a timeout here means no group yet
                log.info("stream %s: the samples stream is failing over (%s); waiting", self.stream_id, e)
                await asyncio.sleep(0.5)
                continue
            except TimeoutError:
                try:
                    st = await self._live()
                except StreamClosed:
                    await _nak(got)
                    raise
                if st.state == "completed" and not st.open:
                    if got:
                        break
                    raise StreamEnded(f"stream {st.id} delivered all its groups") from None
                continue
            for m in msgs:
                try:
                    g = decode(m.data, SampleGroup)
                except DecodeError as e:
                    log.error("stream %s: undecodable group dropped: %s", self.stream_id, e)
                    await m.term()
                    continue
                (got if bound.admits(g.start_version, st.version) else stale).append((m, g))
            if stale and len(got) < n_groups:
                # Reported now, not with the batch: the stream samples their tasks again only once told, and
                # the batch may need those very tasks (a finite stream whose every task is started waits on
                # them for ever otherwise).
                await self._drop(stale, st.version)
                dropped += len(stale)
                stale = []
        # In the order the stream opened them, not the order they finished: a batch of the same groups is the
        # same batch (its minibatches, its gradients), however the engines' timings fell.
        got.sort(key=lambda mg: mg[1].group)
        groups = await asyncio.gather(*(self._read_group(g) for _, g in got))
        # Acknowledged before reported: a group reaches at most one trainer; the report is idempotent.
        for m, _ in got + stale:
            await m.ack()
        taken = BatchTaken(self.stream_id, st.version, [g.group for _, g in got], [g.group for _, g in stale])
        await self.report(taken)
        return Batch(
            groups=list(groups),
            version=st.version,
            stale=dropped + len(stale),
            waited_s=time.monotonic() - t0,
            staleness=[st.version - g.start_version for _, g in got],
        )

    async def _drop(self, stale: list[tuple[Msg, SampleGroup]], version: int) -> None:
        for m, _ in stale:
            await m.ack()
        await self.report(BatchTaken(self.stream_id, version, [], [g.group for _, g in stale]))

    async def _read_group(self, g: SampleGroup) -> Group:
        trajs = []
        for seq in g.seqs:
            m = await bus.through_failover(
                functools.partial(self.js.get_msg, subjects.STREAM_RESULTS, seq=seq)
            )
            assert m.data is not None
            trajs.append(decode(m.data, Trajectory))
        return Group(g.stream_id, g.group, g.task_id, g.start_version, trajs)

    async def close(self, delete: bool = False) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()
        if delete:
            try:
                await self.js.delete_consumer(subjects.STREAM_SAMPLES, consumer_name(self.stream_id))
            except Exception as e:
                log.debug("consumer of %s not deleted: %s", self.stream_id, e)


async def _nak(held: list[tuple[Msg, SampleGroup]]) -> None:
    for m, _ in held:
        await m.nak()

"""The trainer SDK: a rollout stream seen from the trainer, over NATS only (never a service's internals).

```python
async with await StreamClient.create("nats://127.0.0.1:4222", spec) as stream:
    for step in range(steps):
        batch = await stream.get_batch(8, timeout=600)
        ...  # train on batch.groups
        await stream.update_weights(step + 1, model=model, transport=transport)  # loom.weights.publish
```

``SyncStreamClient`` offers the same for a synchronous training loop; the scheduler's REST edge offers it to
other languages (``/v1/streams``). The client renews the stream's lease while it is open: a trainer that
disappears releases its stream after ``lease_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from nats.aio.client import Client as NATS

from loom.protocol import (
    BatchTaken,
    Stream,
    StreamRef,
    StreamSpec,
    WeightUpdate,
    WeightUpdateResult,
    subjects,
)
from loom.runtime import bus
from loom.runtime.leader import ask_active
from loom.trainer.buffer import Batch, SampleBuffer
from loom.weights.publish import Transport, Weights, deliver_during

log = logging.getLogger(__name__)
T = TypeVar("T")


class StreamClient:
    def __init__(self, nc: NATS, stream: Stream, own_connection: bool = False) -> None:
        self.nc = nc
        self.stream = stream
        self.id = stream.id
        self._own = own_connection
        self.buffer = SampleBuffer(nc.jetstream(timeout=30), stream.id, self.refresh, self._report)
        self._lease: asyncio.Task[None] | None = asyncio.create_task(
            self._renew_forever(), name=f"lease-{stream.id}"
        )

    # ------------------------------------------------------------------ opening

    @classmethod
    async def create(cls, nats: str | NATS, spec: StreamSpec, timeout_s: float = 60.0) -> StreamClient:
        nc, own = await _connect(nats)
        st = await ask_active(nc, subjects.STREAM_CREATE, spec, Stream, timeout_s=timeout_s)
        return cls(nc, st, own)

    @classmethod
    async def attach(cls, nats: str | NATS, stream_id: str) -> StreamClient:
        """Take over an existing stream (e.g. a restarted trainer): groups it had not taken are still there."""
        nc, own = await _connect(nats)
        st = await ask_active(nc, subjects.STREAM_GET, StreamRef(stream_id), Stream, idempotent=True)
        return cls(nc, st, own)

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ training

    async def get_batch(self, n_groups: int, timeout: float | None = None) -> Batch:  # noqa: ASYNC109
        """Block until ``n_groups`` complete groups within the asynchronous bound are ready; take them."""
        return await self.buffer.take(n_groups, timeout)

    async def update_weights(
        self,
        version: int,
        path: str | None = None,
        timeout: float = 600.0,  # noqa: ASYNC109
        async_fetch: bool = True,
        *,
        model: Weights | None = None,
        transport: Transport | None = None,
    ) -> WeightUpdateResult:
        """Move every engine of the stream's model to ``version``: the checkpoint at ``path``, or ``model``'s
        weights by ``transport`` (``loom.weights.publish``: written to disk, broadcast, or published to the
        store). Engines take disk and store versions while they generate, then pause (requests held, not
        failed), switch all, resume; a broadcast arrives inside the pause. All or nothing: when one worker
        cannot take it, none switches and this raises ``bus.BusError`` with the reason. ``async_fetch``
        false takes every version inside the pause."""
        if transport is None:
            u = WeightUpdate(self.id, version, path, timeout_s=timeout, async_fetch=async_fetch)
            res = await ask_active(
                self.nc, subjects.STREAM_WEIGHTS, u, WeightUpdateResult, timeout_s=timeout + 30
            )
        else:
            if model is None:
                raise ValueError("a transport moves a model's weights: give the model")
            ref = await transport.stage(version, model)
            u = WeightUpdate(
                self.id,
                version,
                ref.path,
                timeout_s=timeout,
                async_fetch=async_fetch and transport.while_generating,
                weights=ref,
            )
            res = await deliver_during(
                transport,
                ref,
                timeout,
                ask_active(self.nc, subjects.STREAM_WEIGHTS, u, WeightUpdateResult, timeout + 30),
            )
        await self.refresh()
        return res

    async def refresh(self) -> Stream:
        self.stream = await ask_active(
            self.nc, subjects.STREAM_GET, StreamRef(self.id), Stream, idempotent=True
        )
        return self.stream

    @property
    def version(self) -> int:
        return self.stream.version

    async def close(self, cancel: bool = True) -> None:
        """Stop renewing the lease; ``cancel`` also ends the stream (its running trajectories stop)."""
        if self._lease is not None:
            self._lease.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease
            self._lease = None
        if cancel and not self.nc.is_closed:
            with contextlib.suppress(bus.BusError, TimeoutError):
                self.stream = await ask_active(
                    self.nc, subjects.STREAM_CANCEL, StreamRef(self.id), Stream, idempotent=True
                )
        await self.buffer.close(delete=cancel)
        if self._own and not self.nc.is_closed:
            await self.nc.drain()

    async def _report(self, taken: BatchTaken) -> None:
        # Asked again through a takeover: the scheduler counts a report's groups once (``streams.taken``).
        try:
            self.stream = await ask_active(
                self.nc, subjects.STREAM_TAKEN, taken, Stream, timeout_s=10, idempotent=True
            )
        except TimeoutError:
            raise TimeoutError(f"the scheduler did not acknowledge the batch taken from {self.id}") from None

    async def _renew_forever(self) -> None:
        period = max(0.5, self.stream.spec.lease_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await ask_active(self.nc, subjects.STREAM_LEASE, StreamRef(self.id), Stream, idempotent=True)
            except Exception as e:  # the next renewal may get through; the lease outlasts a few misses
                log.warning("lease renewal of %s failed: %s", self.id, e)


class SyncStreamClient:
    """``StreamClient`` for a synchronous training loop: the client runs on its own event loop thread."""

    def __init__(self, nats: str, spec: StreamSpec | None = None, stream_id: str | None = None) -> None:
        if (spec is None) == (stream_id is None):
            raise ValueError("give a spec to create a stream or the id of one to attach to")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="loom-trainer", daemon=True)
        self._thread.start()
        opening = (
            StreamClient.create(nats, spec)
            if spec is not None
            else StreamClient.attach(nats, stream_id or "")
        )
        self._client: StreamClient = self._run(opening)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def id(self) -> str:
        return self._client.id

    @property
    def version(self) -> int:
        return self._client.version

    def get_batch(self, n_groups: int, timeout: float | None = None) -> Batch:
        return self._run(self._client.get_batch(n_groups, timeout))

    def update_weights(
        self,
        version: int,
        path: str | None = None,
        timeout: float = 600.0,
        async_fetch: bool = True,
        *,
        model: Weights | None = None,
        transport: Transport | None = None,
    ) -> WeightUpdateResult:
        return self._run(
            self._client.update_weights(version, path, timeout, async_fetch, model=model, transport=transport)
        )

    def close(self, cancel: bool = True) -> None:
        try:
            self._run(self._client.close(cancel))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> SyncStreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _connect(nats: str | NATS) -> tuple[NATS, bool]:
    if isinstance(nats, str):
        return await bus.connect(nats, "loom-trainer"), True
    return nats, False

"""Micro-batching with a deadline: requests that arrive together share one model call.

A batch closes when it holds ``max_batch`` requests or its first request has waited ``max_wait_s``; one batch
runs at a time, off the event loop. A request still queued at its deadline is failed with ``TimeoutError``
so that its caller can answer some other way instead of waiting behind a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending(Generic[T, R]):
    item: T
    deadline: float
    future: asyncio.Future[R]


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        fn: Callable[[Sequence[T]], Sequence[R]],
        max_batch: int = 32,
        max_wait_s: float = 0.002,
        on_batch: Callable[[int, float], None] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.fn = fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.on_batch = on_batch
        self._queue: asyncio.Queue[_Pending[T, R]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def submit(self, item: T, timeout_s: float) -> R:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(item, time.monotonic() + timeout_s, fut))
        return await fut

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            p = self._queue.get_nowait()
            if not p.future.done():
                p.future.set_exception(RuntimeError("predictor stopped"))

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            closes = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch:
                left = closes - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), left))
                except TimeoutError:
                    break
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            now = time.monotonic()
            live = []
            for p in batch:
                if p.future.done():
                    continue
                if now > p.deadline:
                    p.future.set_exception(TimeoutError("deadline passed in the queue"))
                else:
                    live.append(p)
            if not live:
                continue
            t0 = time.monotonic()
            try:
                out = await asyncio.to_thread(self.fn, [p.item for p in live])
            except Exception as e:  # one bad batch fails its own requests, not the batcher
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            if self.on_batch:
                self.on_batch(len(live), time.monotonic() - t0)
            for p, r in zip(live, out, strict=True):
                if not p.future.done():
                    p.future.set_result(r)

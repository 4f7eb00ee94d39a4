"""The simulated engine: ``SimCore`` driven in real time (optionally sped up) by a ``Clock``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from typing import Any

from loom.clock import Clock
from loom.engine.base import EngineInfo, EngineLoad, EngineOutput, EngineRequest, cancel_loop
from loom.engine.model.train_perf import weight_sync_s
from loom.engine.sim.core import SimCore, build_core
from loom.engine.token_ids import ids_key, seed_of, synth_ids, synth_logprobs, synth_top_logprobs
from loom.weights import Incoming

__all__ = ["SimCore", "SimEngine"]


class SimEngine:
    """An ``Engine`` whose GPU is ``SimCore``; simulated time is ``clock.now()``.

    One background task advances the core to the clock, resolves finished requests, then sleeps until the
    core's next event or until a submission, abort or control call wakes it.

    A request of lengths (trace replay) gets token counts back. A request that sends its token ids gets
    placeholder output ids and log-probs, a stream keyed by its context and rid (a model with random
    weights, as far as anything downstream can tell); the SGLang-compatible server over it
    (``sglang_server``) synthesizes its own the same way, keyed by the context alone. ``top_logprobs`` gives
    placeholder alternatives around each sampled token (``synth_top_logprobs``); ``stop_token_ids`` end the
    ids at the first one (the simulated run is charged in full). Stop strings need text: the caller's. A
    teacher-forced request (``forced_ids``) runs as a generation of the forced reply's length and returns it.
    """

    def __init__(
        self,
        model: str = "qwen3-8b",
        gpu: str = "h100",
        tp: int = 1,
        clock: Clock | None = None,
        max_running: int = 256,
        mem_fraction: float = 0.9,
        hicache_ratio: float = 0.0,
        weight_link: str | None = None,
    ) -> None:
        self.clock = clock or Clock()
        # The link new weights arrive over ("rdma" within the trainer's cluster, "tcp" from another):
        # preparing them takes RollArt Table 3's transfer time for the model; None: they are local.
        self.fetch_s = weight_sync_s(model, weight_link) if weight_link else 0.0
        self.received_bytes = 0  # of weights that came by broadcast or from a store
        self.core = build_core(
            model,
            gpu,
            tp,
            mem_fraction=mem_fraction,
            max_running=max_running,
            start=self.clock.now(),
            hicache_ratio=hicache_ratio,
        )
        self.perf = self.core.perf
        self.info = EngineInfo(
            kind="sim",
            model=model,
            gpu=gpu,
            tp=tp,
            max_running=max_running,
            kv_capacity_tokens=self.core.kv_capacity,
        )
        self._futures: dict[str, asyncio.Future[EngineOutput]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._paused = False
        self._closed = False
        self._warm_ids = itertools.count()
        self._prepared: dict[str, str | None] = {}  # checkpoints prepared, by weight version
        self.serving_path: str | None = None  # the checkpoint committed last (None: the initial weights)

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("SimEngine is closed")
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.info.model}")

    async def close(self) -> None:
        self._closed = True
        for rid in list(self._futures):
            self._abort(rid)
        await cancel_loop(self._task)
        self._task = None

    async def generate(self, req: EngineRequest) -> EngineOutput:
        if self._task is None or self._task.done() or self._closed:
            raise RuntimeError("SimEngine is not running: await start() first")
        self.core.submit(req, self.clock.now())
        future = asyncio.get_running_loop().create_future()
        self._futures[req.rid] = future
        self._wake.set()
        try:
            return _with_ids(req, await future)
        except asyncio.CancelledError:
            self._abort(req.rid)
            raise
        finally:
            if self._futures.get(req.rid) is future:
                del self._futures[req.rid]

    async def abort(self, rid: str) -> bool:
        return self._abort(rid)

    def load(self) -> EngineLoad:
        return self.core.load()

    async def warm_prefix(self, prefix_key: str, input_len: int) -> None:
        # A prefill-only request, as on SGLang: it queues, pays the prefill, and leaves the prefix cached.
        rid = f"warm-{next(self._warm_ids)}:{prefix_key}"
        await self.generate(
            EngineRequest(rid=rid, input_len=input_len, max_new_tokens=0, prefix_key=prefix_key)
        )

    async def export_prefix(self, prefix_key: str, remove: bool = True) -> int:
        """Tokens cached for ``prefix_key`` (the source side of a migration); ``remove`` frees them here."""
        self._catch_up()
        return self.core.export_prefix(prefix_key, remove)

    async def import_prefix(self, prefix_key: str, tokens: int, bandwidth_gbps: float | None = None) -> None:
        """Receive ``tokens`` of ``prefix_key``'s KV from another engine; returns once they have landed."""
        lands = self.core.import_prefix(prefix_key, tokens, self.clock.now(), bandwidth_gbps)
        await self.clock.sleep(lands - self.clock.now())
        self._catch_up()

    async def prepare_weights(self, version: str, weights: Incoming) -> None:
        """The simulator serves no weights, but takes them as a real engine would: a checkpoint path that does
        not exist fails (tests of a failing worker give one), and a broadcast or a store's version is received
        for real and checked (the trainer's broadcast needs every member of its group), then dropped. A disk
        transfer takes ``fetch_s`` of simulated time; generation goes on meanwhile unless the engine is paused."""
        path = weights.path
        if weights.ref.transport != "disk":
            # Only here: torch stays out of the service images, which run this engine (stack_images).
            from loom.weights.manifest import check_against

            got = await weights.tensors()
            check_against(weights.ref.tensors, got)
            self.received_bytes += sum(t.numel() * t.element_size() for t in got.values())
        elif path is not None and not await asyncio.to_thread(os.path.exists, path):
            raise FileNotFoundError(f"no checkpoint at {path!r} for weight version {version!r}")
        elif path is not None and await asyncio.to_thread(_has_safetensors, path):
            # A real checkpoint is read as an engine reads it (what moving weights by disk costs): every byte,
            # not just mapped (safetensors maps the file).
            got = await weights.tensors()
            self.received_bytes += await asyncio.to_thread(_touch, got)
        if self.fetch_s:
            await self.clock.sleep(self.fetch_s)
        self._prepared[version] = path

    async def commit_weights(self, version: str, flush_cache: bool = True) -> None:
        """Serve ``version``: requests finished before keep the old version, later ones carry the new one.

        The KV cached so far is stale: it is flushed and the requests running now recompute their context
        before they decode on, at prefill cost (``SimCore.commit_weights``). ``flush_cache`` false keeps
        the old KV in use, as SGLang does when told not to flush."""
        if version not in self._prepared:
            raise RuntimeError(f"weight version {version!r} was not prepared")
        self.serving_path = self._prepared.pop(version)
        self._catch_up()
        self.core.commit_weights(version, self.clock.now(), flush_cache)
        self._wake.set()

    async def discard_weights(self, version: str) -> None:
        self._prepared.pop(version, None)

    async def pause(self) -> None:
        self._catch_up()
        self._paused = True
        self._wake.set()

    async def resume(self) -> None:
        if self._paused:
            self.core.stall(self.clock.now())
            self._paused = False
            self._wake.set()

    def _abort(self, rid: str) -> bool:
        self._catch_up()
        out = self.core.abort(rid, self.clock.now())
        if out is None:
            return False
        self._deliver([out])
        self._wake.set()
        return True

    def _catch_up(self) -> None:
        if not self._paused:
            self._deliver(self.core.advance(self.clock.now()))

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            future = self._futures.get(out.rid)
            if future is not None and not future.done():
                future.set_result(out)

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A broken core must not leave callers waiting forever.
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(exc)
            raise

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            delay: float | None = None
            if not self._paused:
                self._catch_up()
                event = self.core.next_event_time()
                if event is not None:
                    delay = self.clock.to_wall(event - self.clock.now())
            if delay is not None and delay <= 0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()


def _with_ids(req: EngineRequest, out: EngineOutput) -> EngineOutput:
    if req.forced_ids is not None:
        # A scripted reply: the core ran it as a generation of its length (a model that wrote it); the ids
        # are the forced ones, and their log-probs a stream keyed by the context and the reply.
        out.output_ids = list(req.forced_ids[: out.output_len])
        out.output_len = len(out.output_ids)
        return _with_logprobs(req, out, f"{ids_key(req.input_ids or [])}/{ids_key(out.output_ids)}")
    if req.input_ids is None or out.output_ids is not None:
        return out
    key = seed_of(req.input_ids, req.rid, req.seed)
    out.output_ids = synth_ids(key, out.output_len)
    if req.stop_token_ids:
        # The run was charged in full (the core knows no tokens); the output ends at the first stop id.
        stops = set(req.stop_token_ids)
        at = next((i for i, t in enumerate(out.output_ids) if t in stops), None)
        if at is not None:
            out.output_ids, out.output_len, out.finish_reason = out.output_ids[: at + 1], at + 1, "stop"
    return _with_logprobs(req, out, key)


def _with_logprobs(req: EngineRequest, out: EngineOutput, key: str) -> EngineOutput:
    assert out.output_ids is not None
    if req.return_logprob or req.top_logprobs:
        lps = synth_logprobs(key + "/lp", out.output_len)
        if req.return_logprob:
            out.output_logprobs = lps
        if req.top_logprobs:
            out.output_top_logprobs = synth_top_logprobs(key + "/top", out.output_ids, lps, req.top_logprobs)
    return out


def _has_safetensors(path: str) -> bool:
    return os.path.isdir(path) and any(name.endswith(".safetensors") for name in os.listdir(path))


def _touch(tensors: dict[str, Any]) -> int:
    return sum(t.clone().numel() * t.element_size() for t in tensors.values())

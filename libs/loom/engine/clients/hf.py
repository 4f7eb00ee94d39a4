"""The transformers engine: a Qwen3-architecture checkpoint generating with real weights on the CPU.

Token ids in, token ids and log-probabilities out, with continuous batching: one background task runs the
engine loop, and each iteration admits waiting requests, prefills them one by one and runs one batched decode
step over every running sequence (``hf_batch.BatchKV``). The torch work of an iteration runs on a single worker
thread, so the event loop stays free for submissions, aborts and control calls; the loop's own state (queues,
futures) is touched only on the event loop.

A request's ``stop_token_ids`` end it as its end-of-turn token does (the token kept); its ``top_logprobs`` are
the most likely tokens of each step under the distribution its token was sampled from (temperature-scaled,
before top-p), as its log-probs are. Stop strings are the caller's to apply: the engine has no tokenizer. A
teacher-forced request (``forced_ids``, a scripted reply) is scored in one forward pass where it would have
been prefilled, with the log-probs and alternatives a sampled reply would have had, and finishes there.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from loom import checkpoints as policy
from loom.engine.base import EngineInfo, EngineLoad, EngineOutput, EngineRequest, cancel_loop
from loom.engine.clients.hf_batch import (
    BatchKV,
    FinishReason,
    Seq,
    prefill,
    request_generator,
    sample_with_top,
    score,
)
from loom.engine.clients.hf_spec import Drafts, StepCost, paying_width, verify_row
from loom.speculative.drafter import MOST, Draft
from loom.weights import Incoming

__all__ = ["HFEngine"]

T = TypeVar("T")


def _inference(fn: Callable[..., T], *args: object) -> T:
    with torch.inference_mode():
        return fn(*args)


class HFEngine:
    """An ``Engine`` over a transformers causal LM; see the module docstring for the shape of its loop.

    Admission reserves a request's whole budget (input + max_new_tokens) of ``kv_capacity_tokens``, so a
    running request is never preempted. There is no prefix cache across requests.
    """

    def __init__(
        self,
        path: str,
        model: str = "qwen3-tiny",
        weight_version: str = "0",
        max_running: int = 32,
        kv_capacity_tokens: int = 65536,
        threads: int = 1,
        seed: int = 0,
        speculative: bool = False,
        draft_most: int = MOST,
    ) -> None:
        self.path = path
        self.info = EngineInfo(
            kind="hf",
            model=model,
            gpu="cpu",
            tp=1,
            max_running=max_running,
            kv_capacity_tokens=kv_capacity_tokens,
        )
        self.weight_version = weight_version
        self.seed = seed
        self.threads = threads
        self._model: PreTrainedModel | None = None
        self._prepared: tuple[str, PreTrainedModel] | None = None
        self._batch = BatchKV()
        # Speculative decoding (hf_spec): drafts from each request's own tokens and every request's output.
        self.drafts = Drafts(most=draft_most) if speculative else None
        self._step_cost = StepCost()
        self._waiting: list[Seq] = []
        self._running: dict[str, Seq] = {}
        self._seqs: dict[str, Seq] = {}
        self._order = itertools.count()
        self._generated = 0
        # Held by each iteration and by pause/commit, which therefore wait for the iteration in flight.
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._paused = False
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        # torch's intra-op thread count is per thread under OpenMP: set it where the work runs.
        self._executor = ThreadPoolExecutor(
            1, "hf-engine", initializer=torch.set_num_threads, initargs=(threads,)
        )

    async def start(self) -> None:
        if self._closed:
            raise RuntimeError("HFEngine is closed")
        if self._model is None:
            self._model = await self._compute(policy.load, self.path)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"hf-engine-{self.info.model}")

    async def close(self) -> None:
        self._closed = True
        for rid in list(self._seqs):
            self._abort(rid)
        await cancel_loop(self._task)
        self._task = None
        # Let an iteration still on the worker thread finish before the tensors go.
        await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._batch.clear()
        self._prepared = None

    async def generate(self, req: EngineRequest) -> EngineOutput:
        if self._task is None or self._task.done() or self._closed or self._model is None:
            raise RuntimeError("HFEngine is not running: await start() first")
        self._check(req)
        assert req.input_ids is not None
        future: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        seq = Seq(
            req=req,
            prompt=list(req.input_ids),
            order=next(self._order),
            future=future,
            generator=request_generator(self.seed, req.rid, req.seed),
            submitted=time.perf_counter(),
        )
        if req.max_new_tokens == 0:
            # Nothing to generate and no prefix cache to fill: done before it queues.
            seq.finish_reason = "length"
            return self._output(seq)
        self._seqs[req.rid] = seq
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            self._abort(req.rid)
            raise

    async def abort(self, rid: str) -> bool:
        return self._abort(rid)

    def load(self) -> EngineLoad:
        return EngineLoad(
            running=len(self._running),
            waiting=len(self._waiting),
            kv_used_tokens=sum(s.context_len for s in self._running.values()),
            kv_capacity_tokens=self.info.kv_capacity_tokens,
            generated_tokens=self._generated,
        )

    async def warm_prefix(self, prefix_key: str, input_len: int) -> None:
        # No prefix cache across requests: a migrated trajectory pays its prefill wherever it lands.
        return None

    async def prepare_weights(self, version: str, weights: Incoming) -> None:
        if self._model is None:
            raise RuntimeError("HFEngine is not started: no serving weights to check against")
        if weights.ref.transport == "disk":
            if weights.path is None:
                raise ValueError("the transformers engine needs a checkpoint path to prepare weights")
            # Its own thread, not the engine's: serving goes on while a large checkpoint loads.
            model = await asyncio.to_thread(_inference, self._load_checked, weights.path, self._model)
        else:
            state = await weights.tensors()
            model = await asyncio.to_thread(_inference, self._from_state, state, self._model)
        self._prepared = (version, model)

    async def commit_weights(self, version: str) -> None:
        async with self._lock:
            if self._prepared is None or self._prepared[0] != version:
                raise ValueError(f"no weights prepared for version {version!r}")
            await self._compute(self._switch, self._prepared[1])
            self._prepared = None
            self.weight_version = version

    async def discard_weights(self, version: str) -> None:
        if self._prepared is not None and self._prepared[0] == version:
            self._prepared = None

    async def pause(self) -> None:
        async with self._lock:
            self._paused = True

    async def resume(self) -> None:
        self._paused = False
        self._wake.set()

    # Event loop side

    def _check(self, req: EngineRequest) -> None:
        assert self._model is not None
        config = self._model.config
        if req.input_ids is None or not req.input_ids:
            raise ValueError(f"{req.rid}: the transformers engine needs the prompt's token ids (input_ids)")
        if req.rid in self._seqs:
            raise ValueError(f"{req.rid}: a request with this rid is already in flight")
        if min(req.input_ids) < 0 or max(req.input_ids) >= config.vocab_size:
            raise ValueError(f"{req.rid}: token ids must lie in [0, {config.vocab_size})")
        if not 0 <= req.top_logprobs <= config.vocab_size:
            raise ValueError(f"{req.rid}: top_logprobs must lie in [0, {config.vocab_size}]")
        if req.forced_ids is not None and (
            not req.forced_ids or min(req.forced_ids) < 0 or max(req.forced_ids) >= config.vocab_size
        ):
            raise ValueError(f"{req.rid}: forced_ids must be token ids in [0, {config.vocab_size})")
        if req.max_new_tokens < 0 or req.temperature < 0 or not 0 < req.top_p <= 1:
            raise ValueError(f"{req.rid}: needs max_new_tokens >= 0, temperature >= 0 and 0 < top_p <= 1")
        total = len(req.input_ids) + req.max_new_tokens
        limit = min(config.max_position_embeddings, self.info.kv_capacity_tokens)
        if total > limit:
            raise ValueError(
                f"{req.rid}: input ({len(req.input_ids)}) + max_new_tokens ({req.max_new_tokens}) = {total} "
                f"tokens exceeds this engine's limit of {limit} (max positions "
                f"{config.max_position_embeddings}, KV capacity {self.info.kv_capacity_tokens})"
            )

    def _abort(self, rid: str) -> bool:
        seq = self._seqs.get(rid)
        if seq is None:
            return False
        if seq.finish_reason is None:
            seq.finish_reason = "abort"
        self._deliver(seq)
        self._wake.set()
        return True

    def _output(self, seq: Seq) -> EngineOutput:
        now = time.perf_counter()
        # An abort may catch the worker thread mid-append: output_ids is the shorter list, cut both to it.
        n = len(seq.output_ids)
        ids, logprobs, top = seq.output_ids[:n], seq.logprobs[:n], seq.top[:n]
        admitted = seq.admitted if seq.admitted is not None else now
        reason: FinishReason = seq.finish_reason or "abort"
        return EngineOutput(
            rid=seq.req.rid,
            output_len=n,
            finish_reason=reason,
            output_ids=ids,
            queue_s=admitted - seq.submitted,
            prefill_s=seq.prefill_s,
            decode_s=now - seq.prefilled if seq.prefilled is not None else 0.0,
            weight_version=self.weight_version,
            output_logprobs=logprobs if seq.req.return_logprob else None,
            output_top_logprobs=top if seq.req.top_logprobs > 0 else None,
        )

    def _deliver(self, seq: Seq) -> None:
        self._seqs.pop(seq.req.rid, None)
        self._running.pop(seq.req.rid, None)
        with contextlib.suppress(ValueError):
            self._waiting.remove(seq)
        if not seq.future.done():
            seq.future.set_result(self._output(seq))

    def _admit(self) -> list[Seq]:
        """Highest priority first, then arrival order, while a slot and the request's KV budget are free."""
        self._waiting.sort(key=lambda s: (-s.req.priority, s.order))
        reserved = sum(s.budget for s in self._running.values())
        admitted: list[Seq] = []
        while self._waiting and len(self._running) < self.info.max_running:
            seq = self._waiting[0]
            if reserved + seq.budget > self.info.kv_capacity_tokens:
                break
            self._waiting.pop(0)
            seq.admitted = time.perf_counter()
            self._running[seq.req.rid] = seq
            reserved += seq.budget
            admitted.append(seq)
        return admitted

    def _compute(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, functools.partial(_inference, fn, *args))

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A broken iteration must not leave callers waiting forever.
            for seq in list(self._seqs.values()):
                if not seq.future.done():
                    seq.future.set_exception(exc)
            raise

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            if self._paused or not (self._waiting or self._running):
                await self._wake.wait()
                continue
            async with self._lock:
                if self._paused:
                    continue
                await self._compute(self._iterate, self._admit())
                for seq in list(self._running.values()):
                    if seq.finish_reason is not None:
                        self._deliver(seq)

    # Worker thread side

    def _iterate(self, admitted: list[Seq]) -> None:
        model = self._model
        assert model is not None
        if self.drafts is not None:
            for seq in self._batch.rows:
                if seq.finish_reason is not None:
                    self.drafts.retire(seq)
        self._batch.drop_finished()
        for seq in admitted:
            if seq.finish_reason is not None:  # aborted while it waited for this iteration
                continue
            start = time.perf_counter()
            if seq.req.forced_ids is not None:
                # A scripted reply: scored in one pass, done at once (it never joins the decode batch).
                score(model, seq, seq.req.forced_ids[: seq.req.max_new_tokens])
                seq.prefilled = time.perf_counter()
                seq.prefill_s = seq.prefilled - start
                continue
            cache, logits = prefill(model, seq.prompt)
            self._emit([seq], logits[None])
            seq.prefilled = time.perf_counter()
            seq.prefill_s = seq.prefilled - start
            if seq.finish_reason is None:
                self._batch.add(seq, cache)
        if self._batch.rows and not (self.drafts is not None and self._speculate(model, self.drafts)):
            start = time.perf_counter()
            self._emit(self._batch.rows, self._batch.step(model))
            self._step_cost.observe(len(self._batch.rows), time.perf_counter() - start)

    def _speculate(self, model: PreTrainedModel, drafts: Drafts) -> bool:
        """One verification step over the batch, as wide as its drafts pay for under this engine's measured
        step cost, if any (else False: a plain step)."""
        rows = self._batch.rows
        proposed = [drafts.draft(s) if s.finish_reason is None else Draft([]) for s in rows]
        width = paying_width(proposed, self._step_cost.fit())
        proposed = [Draft(d.tokens[:width], d.source, d.rate) for d in proposed]
        if not any(d.tokens for d in proposed):
            return False
        start = time.perf_counter()
        logits = self._batch.verify(model, [d.tokens for d in proposed])
        columns = []
        for i, (seq, d) in enumerate(zip(rows, proposed, strict=True)):
            if seq.finish_reason is not None:
                columns.append(1)
                continue
            emitted, kept = verify_row(seq, d.tokens, logits[i, : len(d.tokens) + 1])
            drafts.feedback(seq, d, kept)
            for token, logprob, top in emitted:
                if seq.finish_reason is not None:
                    break
                seq.append(token, logprob, top)
                self._generated += 1
                drafts.stats.tokens += 1
            drafts.stats.record(len(d.tokens), kept)
            columns.append(1 + kept)
        self._batch.keep(columns, logits.shape[1])
        self._step_cost.observe(len(rows) * logits.shape[1], time.perf_counter() - start)
        return True

    def _emit(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        for seq, (token, logprob, top) in zip(seqs, sample_with_top(logits, seqs), strict=True):
            if seq.finish_reason is None:
                seq.append(token, logprob, top)
                self._generated += 1

    def _switch(self, model: PreTrainedModel) -> None:
        """Serve ``model`` from now on: recompute every running sequence's KV cache under it (its prompt and
        every token but the last, which is the next step's input), so in-flight requests continue under it."""
        batch = BatchKV()
        for seq in self._batch.rows:
            if seq.finish_reason is None:
                cache, _ = prefill(model, seq.prompt + seq.output_ids[:-1])
                batch.add(seq, cache)
        self._model, self._batch = model, batch

    def _from_state(self, state: dict[str, torch.Tensor], serving: PreTrainedModel) -> PreTrainedModel:
        """The serving model's architecture with ``state``'s weights: every tensor it has, no other, each of
        its shape, in the serving model's dtype (load_state_dict raises, naming them, otherwise)."""
        torch.set_num_threads(self.threads)
        model = copy.deepcopy(serving)
        model.load_state_dict(state, strict=True)
        return model

    def _load_checked(self, path: str, serving: PreTrainedModel) -> PreTrainedModel:
        torch.set_num_threads(self.threads)
        model = policy.load(path)  # FileNotFoundError unless path is a checkpoint directory
        new, old = model.config, serving.config
        if new.model_type != old.model_type or new.architectures != old.architectures:
            raise ValueError(
                f"{path}: architecture {new.model_type} {new.architectures} differs from the serving "
                f"{old.model_type} {old.architectures}"
            )
        if new.vocab_size != old.vocab_size:
            raise ValueError(f"{path}: vocab size {new.vocab_size} differs from the serving {old.vocab_size}")
        if new.max_position_embeddings < old.max_position_embeddings:
            # Admitted requests were checked against the serving model's positions.
            raise ValueError(
                f"{path}: max_position_embeddings {new.max_position_embeddings} is below the serving "
                f"{old.max_position_embeddings}"
            )
        logits = model(input_ids=torch.tensor([[0]])).logits
        if logits.shape[-1] < old.vocab_size or not torch.isfinite(logits).all():
            raise ValueError(f"{path}: a one-token forward gives no usable logits")
        return model

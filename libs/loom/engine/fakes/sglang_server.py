"""An SGLang-compatible HTTP API over the simulated engine, so that the SGLang client is tested against it.

It answers SGLang's native endpoints with SGLang's request and response shapes (python/sglang/srt/
entrypoints/http_server.py and managers/io_struct.py upstream): /generate (JSON, or SSE when streamed),
/abort_request, /pause_generation, /continue_generation, /update_weights_from_disk, the weight broadcast's
/init_weights_update_group, /update_weights_from_distributed and /destroy_weights_update_group, /flush_cache,
/get_model_info, /get_weight_version, /get_server_info, /get_load, /health, /health_generate, and /metrics
in Prometheus text with SGLang's metric names. It behaves as SGLang started with
--enable-priority-scheduling and --enable-metrics. Times, in responses and metrics, are simulated seconds.

The simulator generates no text and has no end-of-sequence: every request runs to ``max_new_tokens``, ``text``
is always "", and ``output_ids`` are drawn from the simulators' language model
(``loom.engine.fakes.next_token``) under the request's sampling, merged over ``--preferred-sampling-params``,
seeded by the input ids and the rid (a retry draws the same), or by the input ids and ``sampling_seed`` where
the request gives one (as SGLang under --enable-deterministic-inference; without it SGLang ignores the seed).
Requests must carry ``input_ids``; there is no tokenizer. With ``return_logprob`` the log-probabilities are
that model's as SGLang reports them (log_softmax of the penalised logits at the temperature, before top-k,
top-p and min-p), in SGLang's shape: ``meta_info.output_token_logprobs`` is one [logprob, token_id, null] per
output token, ``input_token_logprobs`` the same for the prompt from ``logprob_start_len`` (-1: its last
position) on, the first entry's logprob null, as SGLang's; with ``top_logprobs_num``
``meta_info.output_top_logprobs`` holds the most likely tokens, one list of [logprob, token_id, null] per
output token. A prompt past ``--context-length``, or an explicit ``max_new_tokens`` that cannot fit, is
refused as SGLang refuses it. ``stop_token_ids`` end the output at the first of them (kept, finish_reason
"stop" with ``matched``); stop strings need text, which the simulator has none of: they never match.

Weight updates (/update_weights_from_disk) follow SGLang's http_server and scheduler: not paused, the update
waits for the requests in flight and holds new ones (SGLang's model-update lock); paused, it loads at once.
A ``model_path`` that names a local path (absolute, or starting with ./, ../ or ~) must be an existing
directory, else the load fails as SGLang's does: HTTP 400, ``success`` false and SGLang's message, the old
weights kept. Any other string stands for a checkpoint that loads. After the load the cache is flushed
(``flush_cache``, default true: the running requests recompute their context, see ``SimCore``; false keeps
the old KV in use). Paused "in_place" or "retract" with requests in flight, SGLang's flush fails and its
scheduler stops on an assertion, which this server answers with HTTP 500 instead. Pause modes: "abort"
aborts what is in flight, "in_place" and "retract" both hold requests where they are. A broadcast update
(/update_weights_from_distributed) takes the same lock and flush rules; its tensors arrive for real
(``weight_transfer``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict

from loom.clock import Clock
from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.fakes.next_token import Sampling, raw_logprob, raw_top, sample
from loom.engine.fakes.serving import generate_for, is_dir, serve_engine
from loom.engine.fakes.weight_transfer import Member, specs
from loom.engine.sim.engine import SimEngine
from loom.engine.token_ids import ContextKeys, seed_of
from loom.weights import Incoming

log = logging.getLogger(__name__)

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
INITIAL_WEIGHT_VERSION = "default"  # what SGLang reports before any update
DISCONNECT_POLL_S = 1.0  # SGLang notices a vanished non-streaming client within seconds too


def _verify_shaping(params: dict[str, Any]) -> None:
    """SGLang's SamplingParams.verify for the fields beyond temperature and top_p (sampling_params.py, 0.5.23):
    top_k is -1 (disabled) or at least 1, never 0; min_p in [0, 1]; repetition_penalty in (0, 2]; presence and
    frequency penalties in [-2, 2]."""
    top_k = params.get("top_k", -1)
    if not isinstance(top_k, int) or (top_k != -1 and top_k < 1):
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    min_p = params.get("min_p", 0.0)
    if not isinstance(min_p, int | float) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
    rep = params.get("repetition_penalty", 1.0)
    if not isinstance(rep, int | float) or not 0 < rep <= 2:
        raise ValueError(f"repetition_penalty must be in (0, 2], got {rep}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = params.get(name, 0.0)
        if not isinstance(value, int | float) or not -2 <= value <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {value}.")


@dataclass(frozen=True, slots=True)
class _Request:
    """A checked request: the engine's, its input ids, the first prompt position whose log-probability the
    response reports (None: no log-probs asked for), and its sampling."""

    req: EngineRequest
    ids: list[int]
    start: int | None
    sampling: Sampling


class GenerateReqInput(BaseModel):
    """The fields of SGLang's GenerateReqInput the simulator acts on; the others are accepted and ignored.
    Batches (lists of prompts) are refused."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    stream: bool = False
    priority: int | None = None


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightFromDiskReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupReqInput(BaseModel):
    group_name: str = "weight_update_group"


class PauseGenerationReqInput(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    torch_empty_cache: bool = True


class _Metrics:
    """SGLang's Prometheus metrics (the subset the simulator can fill), on a registry of their own."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model}
        names = list(self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry)

        self.running = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.queued = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.max_tokens = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool."
        )
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.aborted = counter("sglang:num_aborted_requests_total", "Number of requests aborted.")
        buckets = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            names,
            buckets=buckets,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            names,
            buckets=buckets,
            registry=self.registry,
        )
        self._prompt_total = 0
        self._cached_total = 0
        self._last: tuple[float, int] | None = None  # (simulated time, tokens generated) at the last scrape

    def finished(self, prompt: int, out: EngineOutput) -> None:
        lab = self.labels
        self.prompt_tokens.labels(**lab).inc(prompt)
        self.generation_tokens.labels(**lab).inc(out.output_len)
        self.cached_tokens.labels(**lab).inc(out.cached_tokens)
        self.requests.labels(**lab).inc()
        if out.finish_reason == "abort":
            self.aborted.labels(**lab).inc()
        if out.output_len:
            self.ttft.labels(**lab).observe(out.queue_s + out.prefill_s)
        self.e2e.labels(**lab).observe(out.queue_s + out.prefill_s + out.decode_s)
        self._prompt_total += prompt
        self._cached_total += out.cached_tokens
        # SGLang's hit rate covers recent batches; this one covers the server's life.
        self.cache_hit_rate.labels(**lab).set(
            self._cached_total / self._prompt_total if self._prompt_total else 0
        )

    def exposition(self, engine: SimEngine) -> bytes:
        lab = self.labels
        load = engine.load()
        self.running.labels(**lab).set(load.running)
        self.queued.labels(**lab).set(load.waiting)
        self.used_tokens.labels(**lab).set(load.kv_used_tokens)
        self.token_usage.labels(**lab).set(load.kv_used_tokens / load.kv_capacity_tokens)
        self.max_tokens.labels(**lab).set(load.kv_capacity_tokens)
        now = engine.clock.now()
        if self._last is not None and now > self._last[0]:
            rate = (load.generated_tokens - self._last[1]) / (now - self._last[0])
            self.gen_throughput.labels(**lab).set(rate)
        self._last = (now, load.generated_tokens)
        return generate_latest(self.registry)


@dataclass(frozen=True)
class Options:
    """How the simulated SGLang server was started, of SGLang's flags that change what a client sees."""

    # --preferred-sampling-params: the only server default /generate merges under a request's sampling_params
    # (TokenizerManager._create_tokenized_object); a model's generation_config reaches only the chat route.
    preferred_sampling_params: Mapping[str, Any] = field(default_factory=dict)
    context_length: int | None = None  # --context-length; None: the KV cache's size

    def __post_init__(self) -> None:
        _verify_shaping(dict(self.preferred_sampling_params))


class _SimServer:
    def __init__(self, engine: SimEngine, options: Options) -> None:
        self.engine = engine
        self.preferred = dict(options.preferred_sampling_params)
        self.context_len = options.context_length or engine.info.kv_capacity_tokens
        self.model_path = engine.info.model  # SGLang reports the last checkpoint loaded
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.keys = ContextKeys(engine.info.kv_capacity_tokens)
        self.metrics = _Metrics(engine.info.model)
        self.inflight: set[str] = set()
        self.pause_mode: str | None = None  # PauseGenerationReqInput.mode while paused
        # SGLang's model-update lock: generations hold it as readers, an update not paused as the writer,
        # which waits for the readers to leave and keeps new ones out.
        self._readers = 0
        self._no_readers = asyncio.Event()
        self._no_readers.set()
        self._no_writer = asyncio.Event()
        self._no_writer.set()
        self._updating = asyncio.Lock()
        self.groups: dict[str, Member] = {}  # weight-update groups joined, by name
        self.received_bytes = 0  # of weights taken by broadcast

    # Generation

    async def generate(self, obj: GenerateReqInput, request: Request) -> Response:
        try:
            run = self._request(obj)
        except ValueError as e:
            return _error(e)
        if obj.stream:
            return StreamingResponse(self._stream(run, request), media_type="text/event-stream")
        try:
            return JSONResponse(await self._complete(run, request))
        except ValueError as e:
            return _error(e)

    def _request(self, obj: GenerateReqInput) -> _Request:
        """What ``obj`` asks the engine for, or the error SGLang answers."""
        if obj.text is not None:
            raise ValueError("the simulator has no tokenizer: send input_ids instead of text")
        if not obj.input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        ids = [t for t in obj.input_ids if isinstance(t, int)]
        if len(ids) < len(obj.input_ids):
            raise ValueError("batch requests (a list of prompts) are not supported by the simulator")
        params = {**self.preferred, **(obj.sampling_params or {})}
        max_new = params.get("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
        if not isinstance(max_new, int) or max_new < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
        # TokenizerManager._validate_one_request; an output left unbounded is cut by the scheduler instead.
        limit = self.context_len
        if len(ids) >= limit:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({limit} tokens)."
            )
        if "max_new_tokens" in params and max_new + len(ids) > limit:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You "
                f"requested a total of {max_new + len(ids)} tokens: {len(ids)} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        max_new = min(max_new, limit - len(ids))
        # SGLang's SamplingParams.verify: temperature >= 0 (0 is greedy), top_p in (0, 1].
        temperature, top_p = params.get("temperature", 1.0), params.get("top_p", 1.0)
        if not isinstance(temperature, int | float) or temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {temperature}.")
        if not isinstance(top_p, int | float) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        _verify_shaping(params)
        start = None
        top = obj.top_logprobs_num or 0
        if not isinstance(top, int) or top < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top!r}")
        seed = params.get("sampling_seed")
        if seed is not None and (not isinstance(seed, int) or not -(2**63) <= seed < 2**63):
            raise ValueError(f"sampling_seed must be a 64-bit integer, got {seed!r}")
        stop_ids = params.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
        if obj.return_logprob:
            start = len(ids) - 1 if obj.logprob_start_len in (None, -1) else obj.logprob_start_len
            if not 0 <= start < len(ids):
                raise ValueError(
                    f"logprob_start_len ({obj.logprob_start_len}) must be -1 or a position of the "
                    f"input ({len(ids)} tokens)"
                )
        req = EngineRequest(
            rid=obj.rid or uuid.uuid4().hex,
            input_len=len(ids),
            max_new_tokens=max_new,
            ignore_eos=bool(params.get("ignore_eos", False)),
            priority=float(obj.priority or 0),
            temperature=float(temperature),
            top_p=float(top_p),
            return_logprob=start is not None,
            stop_token_ids=stop_ids or None,
            top_logprobs=top if start is not None else 0,
            seed=seed,
        )
        top_k = params.get("top_k", -1)
        sampling = Sampling(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=0 if top_k == -1 else top_k,
            min_p=float(params.get("min_p", 0.0)),
            repetition_penalty=float(params.get("repetition_penalty", 1.0)),
            presence_penalty=float(params.get("presence_penalty", 0.0)),
            frequency_penalty=float(params.get("frequency_penalty", 0.0)),
        )
        return _Request(req, ids, start, sampling)

    async def _stream(self, run: _Request, request: Request) -> AsyncIterator[bytes]:
        # The simulator reports a request only when it ends, so the stream carries one chunk: the final one.
        try:
            yield _sse(await self._complete(run, request))
        except ValueError as e:
            yield _sse({"error": {"message": str(e)}})
        yield b"data: [DONE]\n\n"

    async def _complete(self, run: _Request, request: Request) -> dict[str, Any]:
        req, ids, start = run.req, run.ids, run.start
        await self._no_writer.wait()  # a weight update is waiting for the requests in flight
        if req.rid in self.inflight:
            raise ValueError(f"Duplicate request ID: {req.rid} is already running")
        req.prefix_key = self.keys.acquire(ids)
        computed = ids
        self.inflight.add(req.rid)
        self._readers += 1
        self._no_readers.clear()
        try:
            out = await self._run(req, request)
            # Off the event loop: a long output takes a while to draw.
            steps = await asyncio.to_thread(
                sample, ids, out.output_len, run.sampling, seed_of(ids, req.rid, req.seed), req.top_logprobs
            )
            output_ids = [st.token for st in steps]
            matched = _first_stop(output_ids, req.stop_token_ids)
            if matched is not None and out.finish_reason != "abort":
                output_ids, steps = output_ids[: matched + 1], steps[: matched + 1]
                out.output_len, out.finish_reason, out.output_ids = len(output_ids), "stop", output_ids
            computed = ids + output_ids
        finally:
            self.inflight.discard(req.rid)
            self.keys.release(req.prefix_key, computed)
            self._readers -= 1
            if not self._readers:
                self._no_readers.set()
        self.metrics.finished(len(ids), out)
        meta = self._meta(req, len(ids), out)
        if start is not None:
            # [logprob, token_id, text]: text only with return_text_in_logprobs, which needs a tokenizer. SGLang
            # reports log_softmax((logits + penalties) / temperature), before top-k, top-p and min-p.
            meta["output_token_logprobs"] = [[st.scaled, st.token, None] for st in steps]
            if req.top_logprobs:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in st.top_scaled] for st in steps]
            meta["input_token_logprobs"] = [
                [raw_logprob(ids[i - 1], ids[i]) if i > start else None, ids[i], None]
                for i in range(start, len(ids))
            ]
            if req.top_logprobs:
                # As SGLang's: a row per input position from logprob_start_len, the first one empty.
                rows = [raw_top(ids[i - 1], req.top_logprobs) for i in range(start + 1, len(ids))]
                meta["input_top_logprobs"] = [[], *([[lp, t, None] for t, lp in row] for row in rows)]
        return {"text": "", "output_ids": output_ids, "meta_info": meta}

    async def _run(self, req: EngineRequest, request: Request) -> EngineOutput:
        return await generate_for(self.engine, req, request, DISCONNECT_POLL_S)

    def _meta(self, req: EngineRequest, prompt: int, out: EngineOutput) -> dict[str, Any]:
        n = out.output_len
        finish: dict[str, Any] = (
            {"type": "abort", "message": "Abort request."}
            if out.finish_reason == "abort"
            else {"type": "stop", "matched": out.output_ids[-1] if out.output_ids else None}
            if out.finish_reason == "stop"
            else {"type": "length", "length": n}
        )
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": prompt,
            "weight_version": out.weight_version or INITIAL_WEIGHT_VERSION,
            "completion_tokens": n,
            "cached_tokens": out.cached_tokens,
            "e2e_latency": out.queue_s + out.prefill_s + out.decode_s,
            # As SGLang reports them with --enable-metrics: from the first forward pass to the end, and the
            # decode rate after the first token.
            "inference_time": out.prefill_s + out.decode_s,
        }
        if n > 1 and out.decode_s > 0:
            meta["decode_throughput"] = (n - 1) / out.decode_s
        return meta

    # Control

    async def abort_request(self, obj: AbortReq) -> Response:
        # SGLang's scheduler aborts every request whose rid starts with the one given.
        for rid in list(self.inflight):
            if obj.abort_all or (obj.rid and rid.startswith(obj.rid)):
                await self.engine.abort(rid)
        return Response(status_code=200)

    async def pause_generation(self, obj: PauseGenerationReqInput | None = None) -> JSONResponse:
        # "retract" and "in_place" both keep requests; the simulator's pause holds them in place.
        mode = (obj or PauseGenerationReqInput()).mode
        if mode == "abort":
            for rid in list(self.inflight):
                await self.engine.abort(rid)
        await self.engine.pause()
        self.pause_mode = mode
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, obj: ContinueGenerationReqInput | None = None) -> JSONResponse:
        await self.engine.resume()
        self.pause_mode = None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        if not obj.model_path:
            return _update_answer(False, "model_path is required")
        if obj.abort_all_requests:
            for rid in list(self.inflight):
                await self.engine.abort(rid)
        return await self._as_writer(functools.partial(self._load, obj))

    async def _as_writer(self, load: Callable[[], Awaitable[JSONResponse]]) -> JSONResponse:
        """An update under SGLang's model-update lock: at once when paused, else after the requests in flight."""
        async with self._updating:
            if self.pause_mode is not None:  # SGLang loads at once when paused
                return await load()
            self._no_writer.clear()
            try:
                await self._no_readers.wait()
                return await load()
            finally:
                self._no_writer.set()

    async def _load(self, obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
        path = obj.model_path
        if path.startswith(("/", "./", "../", "~")) and not await asyncio.to_thread(is_dir, path):
            # SGLang's loader finds no weights there: its model runner answers this, keeping the old weights.
            return _update_answer(False, f"Failed to get weights iterator: no model directory at {path}.")
        refused = self._flush_refused(obj.flush_cache)
        if refused is not None:
            return refused
        self.model_path = path
        return _update_answer(
            True,
            await self._switch("Succeeded to update model weights.", obj.weight_version, obj.flush_cache),
        )

    def _flush_refused(self, flush_cache: bool) -> JSONResponse | None:
        load = self.engine.load()
        if flush_cache and self.pause_mode in ("in_place", "retract") and load.running + load.waiting:
            # SGLang loads the weights, then its cache flush finds requests in the batch or, retracted, in
            # the queue, and the scheduler stops on `assert flush_cache_success`: the server is gone.
            # Refused here, loudly, instead.
            message = (
                f"Cache flush failed after updating weights: requests are in flight while generation is "
                f"paused ({self.pause_mode}), so send flush_cache false; SGLang's scheduler dies on this "
                "assertion"
            )
            log.error(message)
            return _update_answer(False, message, status=500)
        return None

    async def _switch(self, message: str, weight_version: str | None, flush_cache: bool) -> str:
        """The engine serves the new weights (labelled ``weight_version`` if given); SGLang's message."""
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        await self.engine.prepare_weights(self.weight_version, Incoming.disk(None))
        await self.engine.commit_weights(self.weight_version, flush_cache=flush_cache)
        if flush_cache:
            self.keys.clear()
        return message

    # Weights by broadcast (weight_transfer.Member: joins the trainer's group over gloo)

    async def init_weights_update_group(self, obj: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        if obj.group_name in self.groups:
            return _update_answer(False, f"Process group {obj.group_name!r} already exists.")
        try:
            self.groups[obj.group_name] = await Member.join(
                obj.master_address,
                obj.master_port,
                obj.rank_offset,
                obj.world_size,
                obj.backend,
                obj.group_name,
            )
        except Exception as e:
            return _update_answer(False, f"Failed to initialize custom process group: {e}.")
        return _update_answer(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(
        self, obj: UpdateWeightsFromDistributedReqInput
    ) -> JSONResponse:
        member = self.groups.get(obj.group_name)
        if member is None:
            return _update_answer(False, f"Group {obj.group_name} not in _model_update_group.")
        if obj.load_format not in (None, "flattened_bucket"):
            return _update_answer(False, f"Unknown load_format {obj.load_format!r} for a distributed update.")
        try:
            tensors = specs(obj.names, obj.dtypes, obj.shapes)
        except ValueError as e:
            return _update_answer(False, str(e))
        if obj.abort_all_requests:
            for rid in list(self.inflight):
                await self.engine.abort(rid)

        async def load() -> JSONResponse:
            refused = self._flush_refused(obj.flush_cache)
            if refused is not None:
                return refused
            try:
                await member.take(tensors, "flattened" if obj.load_format else "per_tensor")
            except Exception as e:
                return _update_answer(False, f"Failed to update parameter online: {e}.")
            message = "Succeeded to update parameter online from distributed."
            return _update_answer(True, await self._switch(message, obj.weight_version, obj.flush_cache))

        return await self._as_writer(load)

    async def destroy_weights_update_group(self, obj: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        member = self.groups.pop(obj.group_name, None)
        if member is None:
            return _update_answer(False, f"Group {obj.group_name} not in _model_update_group.")
        try:
            await member.check()  # the simulator's own check: every byte against the trainer's checksum
        except Exception as e:
            return _update_answer(False, f"Weights received corrupt: {e}.")
        finally:
            await member.leave()
        self.received_bytes += member.bytes
        return _update_answer(True, "Succeeded to destroy custom process group.")

    async def flush_cache(self) -> PlainTextResponse:
        # Forgetting every context key makes the cached prefixes unreachable; the simulator evicts them.
        load = self.engine.load()
        idle = load.running == load.waiting == 0
        if not idle:
            return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)
        self.keys.clear()
        return PlainTextResponse("Cache flushed.\n")

    # Information

    async def health(self) -> Response:
        return Response(status_code=200)

    async def health_generate(self) -> Response:
        # As SGLang does: one token of a one-token prompt, kept out of the metrics.
        rid = f"HEALTH_CHECK_{time.time()}"
        try:
            async with asyncio.timeout(20):
                await self.engine.generate(EngineRequest(rid=rid, input_len=1, max_new_tokens=1))
        except (TimeoutError, RuntimeError):
            return Response(status_code=503)
        return Response(status_code=200)

    async def get_model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": json.dumps(self.preferred) if self.preferred else None,
            "weight_version": self.weight_version,
        }

    async def models(self) -> dict[str, Any]:
        # SGLang's /v1/models card carries the context length as max_model_len (http_server.py).
        card = {"id": self.engine.info.model, "object": "model", "created": int(time.time()),
                "owned_by": "sglang", "root": self.model_path, "max_model_len": self.context_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def get_weight_version(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version}

    async def get_server_info(self) -> dict[str, Any]:
        info = self.engine.info
        return {
            "model_path": self.model_path,
            "served_model_name": info.model,
            "tp_size": info.tp,
            "dp_size": 1,
            "page_size": 1,
            "max_running_requests": info.max_running,
            "max_total_tokens": info.kv_capacity_tokens,
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": False,
            "enable_metrics": True,
            "weight_version": self.weight_version,
            "status": "ready",
            "max_total_num_tokens": info.kv_capacity_tokens,
            "max_req_input_len": info.kv_capacity_tokens - 1,
            "internal_states": [{"effective_max_running_requests_per_dp": info.max_running}],
            "version": "loom-sim",
        }

    async def get_load(self) -> list[dict[str, int]]:
        load = self.engine.load()
        return [
            {
                "dp_rank": 0,
                "num_reqs": load.running + load.waiting,
                "num_waiting_reqs": load.waiting,
                "num_tokens": load.kv_used_tokens,
            }
        ]

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(self.engine), media_type=CONTENT_TYPE_LATEST)


def build_app(engine: SimEngine, options: Options | None = None) -> FastAPI:
    """SGLang's HTTP API over ``engine``, which the caller starts and closes."""
    server = _SimServer(engine, options or Options())
    app = FastAPI(title="Loom simulated engine (SGLang-compatible)")
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_api_route("/generate", server.generate, methods=["POST", "PUT"])
    app.add_api_route("/abort_request", server.abort_request, methods=["POST"])
    app.add_api_route("/pause_generation", server.pause_generation, methods=["POST"])
    app.add_api_route("/continue_generation", server.continue_generation, methods=["POST"])
    app.add_api_route("/update_weights_from_disk", server.update_weights_from_disk, methods=["POST"])
    app.add_api_route("/init_weights_update_group", server.init_weights_update_group, methods=["POST"])
    app.add_api_route(
        "/update_weights_from_distributed", server.update_weights_from_distributed, methods=["POST"]
    )
    app.add_api_route("/destroy_weights_update_group", server.destroy_weights_update_group, methods=["POST"])
    app.add_api_route("/flush_cache", server.flush_cache, methods=["GET", "POST"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/health_generate", server.health_generate, methods=["GET"])
    app.add_api_route("/get_model_info", server.get_model_info, methods=["GET"])
    app.add_api_route("/get_weight_version", server.get_weight_version, methods=["GET"])
    app.add_api_route("/get_server_info", server.get_server_info, methods=["GET"])
    app.add_api_route("/get_load", server.get_load, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    return app


async def serve(host: str, port: int, model: str, gpu: str, tp: int, speed: float, options: Options) -> None:
    """Run the simulated engine behind SGLang's API until SIGTERM or SIGINT; port 0 picks a free port."""
    engine = SimEngine(model=model, gpu=gpu, tp=tp, clock=Clock(speed))
    await serve_engine(engine, build_app(engine, options), host, port, "SGLang", speed)


def _update_answer(success: bool, message: str, status: int | None = None) -> JSONResponse:
    """SGLang's answer to a weight update: 200 on success, else 400, with the same body."""
    body = {"success": success, "message": message, "num_paused_requests": 0}
    return JSONResponse(body, status_code=status or (200 if success else 400))


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _error(e: ValueError) -> JSONResponse:
    """SGLang's answer to a request its engine refuses."""
    return JSONResponse({"error": {"message": str(e)}}, status_code=400)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """SGLang answers a body that does not validate with 400 (FastAPI's default is 422)."""
    return JSONResponse(
        {"object": "error", "message": str(exc), "type": "Bad Request", "param": None, "code": 400},
        status_code=400,
    )


def _first_stop(output_ids: list[int], stop_ids: list[int] | None) -> int | None:
    """The position of the first stop token id in the output, if any."""
    if not stop_ids:
        return None
    stops = set(stop_ids)
    return next((i for i, t in enumerate(output_ids) if t in stops), None)

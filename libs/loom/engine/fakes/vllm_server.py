"""A vLLM-compatible HTTP API over the simulated engine, so that the vLLM client is tested against it.

It answers the routes of a vLLM 0.33 server started with ``VLLM_SERVER_DEV_MODE=1 --scheduling-policy priority
--logprobs-mode processed_logprobs --enable-per-request-metrics --enable-prompt-tokens-details``, with vLLM's
request and response shapes (paths inside the vllm 0.33.0 wheel): ``/v1/completions`` (entrypoints/openai/
completion/protocol.py and serving.py), ``/v1/models`` (entrypoints/openai/models), ``/health`` and ``/version``
(entrypoints/serve/instrumentator), ``/metrics`` in Prometheus text with vLLM's names and labels
(v1/metrics/loggers.py), and the dev-mode routes ``/abort_requests``, ``/pause``, ``/resume``, ``/is_paused``,
``/update_weight_version``, ``/weight_info``, the weight-transfer engine's ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` and ``/shutdown_weight_transfer_engine``
(entrypoints/rl/online/api_router.py; the tensors arrive for real, over gloo: ``weight_transfer``), ``/collective_rpc`` with the
workers' ``reload_weights`` and ``update_config`` (entrypoints/serve/dev/rpc/api_router.py,
v1/worker/gpu_worker.py), ``/reset_prefix_cache`` (entrypoints/serve/dev/cache/api_router.py) and
``/server_info`` (entrypoints/serve/dev/server_info/api_router.py: the VllmConfig fields a client reads).
Times, in responses and metrics, are simulated seconds.

The simulator has no tokenizer and no end-of-sequence: prompts must be token ids, every request runs to
``max_tokens``, ``text`` is always "", tokens are named ``"token_id:N"`` in log-probs whether or not
``return_tokens_as_token_ids`` is set, and the output ids are drawn from the simulators' language model
(``loom.engine.fakes.next_token``) under the request's sampling, each field it leaves out filled from the
``generation_config`` the server was given, as ``--generation-config auto`` does; the draw is seeded by the
prompt and the request id (a retry draws the same), or by the prompt and the request's ``seed`` where it gives
one. Log-probs are that model's, of the distribution drawn from
(``--logprobs-mode processed_logprobs``) or of the raw one, and a prompt's ``prompt_logprobs`` are the model's
own; top alternatives are the most likely tokens. Past ``--max-model-len`` a request is refused, or its output
cut, as vLLM's is. ``stop_token_ids`` end the output at the first of them (kept, ``stop_reason``
the id); stop strings need text and never match. Streaming, ``n`` > 1 and ``echo`` are refused.

Priorities are vLLM's (lower served first, here mapped onto the simulator's larger-first queue), and like vLLM's
scheduler the simulator preempts a running request only when KV runs out, never for a gap in priority. Pause
modes: "keep" holds every request where it is and queues new ones; "abort" aborts what is in flight and "wait"
lets it finish, both refusing new requests (HTTP 503) until ``/resume``. ``reload_weights`` takes its path from
``weights_path``, else from the last ``update_config`` of ``model_config.model``; a local path (absolute, or
starting with ./, ../ or ~) must be an existing directory, else the call fails with HTTP 500 and the old weights
stay (vLLM's are left half loaded then). A reload changes no KV: ``/reset_prefix_cache`` does, and with
``reset_running_requests`` the running requests recompute their context (``SimCore.commit_weights``); without
it the reset fails (``success`` false) while requests run. Outputs carry the version ``/update_weight_version``
set last, one span per output. A ``prompt_logprobs`` request reads no cached prefix, as vLLM skips the prefix
cache for them.

What the server received (request ids, priorities, aborts, pauses, reloads, version labels, cache resets, scoring requests)
is kept for tests at ``GET /loom/received``, a route of the simulator's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field

from loom.clock import Clock
from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.clients.vllm import engine_rid
from loom.engine.fakes.next_token import Sampling, Step, raw_logprob, raw_top, sample
from loom.engine.fakes.serving import generate_for, is_dir, serve_engine
from loom.engine.fakes.weight_transfer import Member, specs
from loom.engine.sim.engine import SimEngine
from loom.engine.token_ids import ContextKeys, seed_of
from loom.weights import GROUP, Incoming

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
INITIAL_WEIGHT_VERSION = "default"  # what vLLM's engine core labels its weights before any update
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
BLOCK_SIZE = 16  # vLLM's default KV block size on GPUs
DISCONNECT_POLL_S = 1.0
RECEIVED_KEPT = 10_000  # entries of each record kept for /loom/received


class CompletionRequest(BaseModel):
    """The fields of vLLM's CompletionRequest the simulator acts on; the others are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1
    stream: bool | None = False
    echo: bool | None = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    # The request's own sampling seed: vLLM's CompletionRequest bounds it to a signed 64-bit integer.
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)


class AbortRequests(BaseModel):
    model_config = ConfigDict(extra="ignore")

    request_ids: list[str] | None = None


class CollectiveRpc(BaseModel):
    # "kwargs" would clash with pydantic's __init__(**kwargs) in the type checker's plugin.
    model_config = ConfigDict(populate_by_name=True)

    method: str
    args: list[Any] = Field(default_factory=list)
    keywords: dict[str, Any] = Field(default_factory=dict, alias="kwargs")
    timeout: float | None = None


class UpdateWeightVersion(BaseModel):
    new_version: str


class NCCLInitInfo(BaseModel):
    """vLLM's ``NCCLWeightTransferInitInfo`` (distributed/weight_transfer/nccl_common.py): unknown fields are
    refused, as its ``cls(**init_info)`` refuses them."""

    model_config = ConfigDict(extra="forbid")

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


class NCCLUpdateInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class InitWeightTransfer(BaseModel):
    init_info: dict[str, Any]


class UpdateWeights(BaseModel):
    update_info: dict[str, Any]


class FinishWeightUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    weight_version: str | None = None


class Received(BaseModel):
    """What the server was asked to do, in order (the last ``RECEIVED_KEPT`` of each)."""

    requests: list[str] = Field(default_factory=list)  # request_id of every completion request
    priorities: list[int] = Field(default_factory=list)  # of every completion request, as sent
    aborted: list[str] = Field(default_factory=list)  # ids /abort_requests named ("*": all)
    pauses: list[str] = Field(default_factory=list)  # modes
    resumes: int = 0
    reloads: list[str] = Field(default_factory=list)  # checkpoints reload_weights loaded
    versions: list[str] = Field(default_factory=list)  # labels /update_weight_version set
    cache_resets: list[bool] = Field(default_factory=list)  # reset_running_requests of each success
    scored: int = 0  # completion requests with prompt_logprobs
    transferred: list[str] = Field(default_factory=list)  # versions finished by the weight-transfer engine
    sampling: list[dict[str, float]] = Field(default_factory=list)  # each completion's effective sampling


class _Metrics:
    """vLLM's Prometheus metrics (the subset the simulator can fill), on a registry of their own."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model, "engine": "0"}
        names = list(self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"]
        )
        buckets = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."
        )
        self._generated = 0
        self._preempted = 0

    def finished(self, prompt: int, out: EngineOutput) -> None:
        lab = self.labels
        self.prompt_tokens.labels(**lab).inc(prompt)
        self.queries.labels(**lab).inc(prompt)
        self.hits.labels(**lab).inc(out.cached_tokens)
        self.success.labels(**lab, finished_reason=out.finish_reason).inc()
        if out.output_len:
            self.ttft.labels(**lab).observe(out.prefill_s)
        self.queue.labels(**lab).observe(out.queue_s)
        self.e2e.labels(**lab).observe(out.queue_s + out.prefill_s + out.decode_s)

    def exposition(self, engine: SimEngine) -> bytes:
        lab = self.labels
        load = engine.load()
        self.running.labels(**lab).set(load.running)
        self.waiting.labels(**lab).set(load.waiting)
        self.kv_usage.labels(**lab).set(load.kv_used_tokens / load.kv_capacity_tokens)
        # vLLM counts tokens and preemptions as iterations run, not as requests end.
        self.generation_tokens.labels(**lab).inc(load.generated_tokens - self._generated)
        self.preemptions.labels(**lab).inc(engine.core.preemptions - self._preempted)
        self._generated, self._preempted = load.generated_tokens, engine.core.preemptions
        return generate_latest(self.registry)


class _Refused(Exception):
    """A request vLLM would answer with an error (``ErrorResponse``)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


# vLLM's CompletionRequest._DEFAULT_SAMPLING_PARAMS: what a field left out (None) falls back to when the model's
# generation_config sets nothing for it (openai/completion/protocol.py, vLLM 0.33).
OPENAI_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                     "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}  # fmt: skip


@dataclass(frozen=True)
class Options:
    """How the simulated vLLM server was started, of vLLM's flags that change what a client sees."""

    # What --generation-config auto (vLLM's default) reads from the checkpoint's generation_config.json: every
    # field a request leaves out takes it (ModelConfig.get_diff_sampling_param).
    generation_defaults: Mapping[str, float] = field(default_factory=dict)
    # --logprobs-mode: "processed_logprobs" reports the distribution a token was drawn from, vLLM's default
    # "raw_logprobs" the model's before temperature, penalties and truncation.
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "processed_logprobs"
    max_model_len: int | None = None  # --max-model-len; None: the KV cache's size
    # Seconds a completion spends being prepared (rendered, tokenized, its limits checked) before the engine
    # registers it: an /abort_requests meanwhile finds nothing, as on vLLM.
    prepare_s: float = 0.0

    def __post_init__(self) -> None:
        unknown = set(self.generation_defaults) - set(OPENAI_DEFAULTS)
        if unknown:
            raise ValueError(f"generation defaults vLLM does not apply: {sorted(unknown)}")


class _SimServer:
    def __init__(self, engine: SimEngine, options: Options) -> None:
        self.engine = engine
        self.generation_defaults = dict(options.generation_defaults)
        self.logprobs_mode = options.logprobs_mode
        self.prepare_s = options.prepare_s
        self.served = engine.info.model
        self.model_path = engine.info.model  # model_config.model: the checkpoint loaded last
        self.next_path = self.model_path  # what update_config set for the next reload
        self.weight_version = INITIAL_WEIGHT_VERSION
        self.capacity = engine.info.kv_capacity_tokens
        # vLLM refuses to start with a context that its KV cache cannot hold.
        self.max_model_len = options.max_model_len or self.capacity
        if self.max_model_len > self.capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the KV cache's {self.capacity} tokens"
            )
        self.keys = ContextKeys(self.capacity)
        self.metrics = _Metrics(self.served)
        self.received = Received()
        self.inflight: set[str] = set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.pause_mode: str | None = None
        self.refusing = False  # paused "abort" or "wait": new requests get 503
        # The weight-transfer engine (weight_transfer.Member: the trainer's group, joined over gloo).
        self.transfer: Member | None = None
        self.transfer_info: NCCLInitInfo | None = None
        self.updating = False  # between /start_weight_update and /finish_weight_update
        self.received_bytes = 0

    # Generation

    async def completions(self, obj: CompletionRequest, request: Request) -> JSONResponse:
        try:
            return JSONResponse(await self._complete(obj, request))
        except _Refused as e:
            return _error(str(e), e.status, e.param)

    async def _complete(self, obj: CompletionRequest, request: Request) -> dict[str, Any]:
        ids, max_tokens = self._check(obj)
        if self.refusing:
            raise _Refused("The engine is paused: retry after /resume.", 503)
        # A proxy's X-Request-Id header names the request in place of the body's (_base_request_id).
        external = request.headers.get("X-Request-Id") or obj.request_id
        rid = engine_rid(external)
        if rid in self.inflight:
            raise _Refused(f"the simulator already runs request {external!r}")
        _keep(self.received.requests, external)
        _keep(self.received.priorities, obj.priority)
        sampling = self.sampling(obj)
        _keep(self.received.sampling, dataclasses.asdict(sampling))
        scoring = obj.prompt_logprobs is not None
        self.received.scored += scoring
        # vLLM reads no cached prefix for a prompt_logprobs request: a key of its own misses the cache.
        key = f"score-{rid}" if scoring else self.keys.acquire(ids)
        stops = set(obj.stop_token_ids or ())
        req = EngineRequest(
            rid=rid,
            input_len=len(ids),
            max_new_tokens=max_tokens,
            prefix_key=key,
            ignore_eos=obj.ignore_eos,
            priority=-float(obj.priority),  # vLLM serves lower values first, the simulator larger ones
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_token_ids=sorted(stops) or None,
        )
        computed = ids
        self.inflight.add(rid)
        self.idle.clear()
        try:
            out = await self._run(req, request)
            # Off the event loop: a long output takes a while to draw.
            steps = await asyncio.to_thread(
                sample, ids, out.output_len, sampling, seed_of(ids, rid, obj.seed), obj.logprobs or 0
            )
            stop = next((i for i, st in enumerate(steps) if st.token in stops), None)
            if stop is not None and out.finish_reason != "abort":
                steps = steps[: stop + 1]
                out.output_len, out.finish_reason = len(steps), "stop"
            computed = ids + [st.token for st in steps]
        except ValueError as e:  # the engine refuses it (larger than its KV cache)
            raise _Refused(str(e)) from e
        finally:
            self.inflight.discard(rid)
            if not self.inflight:
                self.idle.set()
            if not scoring:
                self.keys.release(key, computed)
        self.metrics.finished(len(ids), out)
        return self._response(obj, external, ids, steps, out)

    def _check(self, obj: CompletionRequest) -> tuple[list[int], int]:
        """The prompt's ids and the tokens to generate, or the error vLLM answers (and those of the
        simulator: text, batches, streams)."""
        if obj.model is not None and obj.model != self.served:
            raise _Refused(f"The model `{obj.model}` does not exist. Valid aliases: {self.served}.", 404)
        if isinstance(obj.prompt, str) or (obj.prompt and isinstance(obj.prompt[0], str)):
            raise _Refused("the simulator has no tokenizer: send the prompt as token ids")
        if not obj.prompt:
            raise _Refused("Either prompt or prompt_embeds must be provided and non-empty.")
        ids = [t for t in obj.prompt if isinstance(t, int)]
        if len(ids) < len(obj.prompt):
            raise _Refused("batch requests (a list of prompts) are not supported by the simulator")
        if obj.stream or obj.n != 1 or obj.echo:
            raise _Refused("the simulator serves neither streams, n > 1 nor echo")
        max_tokens = 16 if obj.max_tokens is None else obj.max_tokens
        # vLLM's SamplingParams._verify_args and CompletionRequest.check_logprobs.
        if max_tokens < 1:
            raise _Refused(f"max_tokens must be at least 1, got {max_tokens}.")
        if obj.temperature is not None and not 0 <= obj.temperature <= 2:
            raise _Refused(f"temperature must be in [0, 2], got {obj.temperature}.")
        if obj.top_p is not None and not 0 < obj.top_p <= 1:
            raise _Refused(f"top_p must be in (0, 1], got {obj.top_p}.")
        if obj.top_k is not None and obj.top_k < -1:
            raise _Refused(f"top_k must be 0 (disable), or at least 1, got {obj.top_k}.")
        if obj.min_p is not None and not 0 <= obj.min_p <= 1:
            raise _Refused(f"min_p must be in [0, 1], got {obj.min_p}.")
        if obj.repetition_penalty is not None and not 0 < obj.repetition_penalty < float("inf"):
            raise _Refused(f"repetition_penalty must be a positive float, got {obj.repetition_penalty}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(obj, name)
            if value is not None and not -2 <= value <= 2:
                raise _Refused(f"{name} must be in [-2, 2], got {value}.")
        for name, k in (("sample", obj.logprobs), ("prompt", obj.prompt_logprobs)):
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise _Refused(f"Requested {name} logprobs of {k}, which is greater than max allowed: 20")
        if any(t < 0 for t in ids):
            raise _Refused("token ids must be non-negative")
        # vLLM's TokenizeParams (renderers/params.py) and get_max_tokens (serve/utils/api_utils.py).
        limit = self.max_model_len
        if max_tokens > limit:
            raise _Refused(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. Please request fewer "
                "output tokens.",
                param="max_tokens",
            )
        if len(ids) > limit:
            raise _Refused(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(ids)} input tokens, which exceeds this limit even without any output tokens. Please "
                "reduce the length of the input prompt.",
                param="input_tokens",
            )
        # Within the limit, an output that cannot fit is cut to what does: it ends with "length".
        max_tokens = min(max_tokens, limit - len(ids))
        if max_tokens < 1:
            raise _Refused(f"max_tokens must be at least 1, got {max_tokens}.")
        return ids, max_tokens

    def sampling(self, obj: CompletionRequest) -> Sampling:
        """The request's sampling as vLLM fills it: its own value, else the model's generation default, else
        OpenAI's (CompletionRequest.to_sampling_params: "user -> server default -> OpenAI default")."""
        out: dict[str, Any] = {}
        for name, fallback in OPENAI_DEFAULTS.items():
            value = getattr(obj, name)
            out[name] = self.generation_defaults.get(name, fallback) if value is None else value
        out["top_k"] = 0 if out["top_k"] == -1 else int(out["top_k"])  # vLLM quietly takes -1 as 0, disabled
        return Sampling(**out)

    async def _run(self, req: EngineRequest, request: Request) -> EngineOutput:
        # vLLM's with_cancellation aborts a request whose client went away, as this does, prepared or not.
        return await generate_for(self.engine, req, request, DISCONNECT_POLL_S, self.prepare_s)

    def _response(
        self, obj: CompletionRequest, external: str, ids: list[int], steps: list[Step], out: EngineOutput
    ) -> dict[str, Any]:
        output_ids = [st.token for st in steps]
        n = len(output_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": out.finish_reason,
            "stop_reason": output_ids[-1] if out.finish_reason == "stop" else None,
            "token_ids": output_ids if obj.return_token_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": ids if obj.return_token_ids else None,
            "weight_versions": None,
        }
        if obj.logprobs is not None:
            processed = self.logprobs_mode == "processed_logprobs"
            lps = [st.processed if processed else st.raw for st in steps]
            tops = [st.top_processed if processed else st.top_raw for st in steps]
            choice["logprobs"] = {
                "text_offset": [0] * n,
                "token_logprobs": lps,
                "tokens": [f"token_id:{t}" for t in output_ids],
                # The sampled token, then the top k, as vLLM's completions logprobs hold them.
                "top_logprobs": [
                    {f"token_id:{a}": alp for a, alp in [(t, lp), *row]}
                    for t, lp, row in zip(output_ids, lps, tops, strict=True)
                ],
            }
        if obj.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(ids, obj.prompt_logprobs)
        if obj.return_weight_versions:
            version = out.weight_version or INITIAL_WEIGHT_VERSION
            choice["weight_versions"] = [{"version": version, "start": 0, "end": n}] if n else []
        tokens_per_s = n / (out.prefill_s + out.decode_s) if n and out.prefill_s + out.decode_s > 0 else None
        return {
            "id": f"cmpl-{external}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": n,
                "total_tokens": len(ids) + n,
                "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
            },
            # As --enable-per-request-metrics reports them (build_per_request_timing_metrics).
            "metrics": {
                "queue_time_ms": out.queue_s * 1000,
                "time_to_first_token_ms": out.prefill_s * 1000 if n else None,
                "generation_time_ms": out.decode_s * 1000 if n else None,
                "mean_itl_ms": out.decode_s / (n - 1) * 1000 if n > 1 else None,
                "tokens_per_second": tokens_per_s,
            },
        }

    # Control

    async def abort_requests(self, obj: AbortRequests) -> JSONResponse:
        ids = obj.request_ids or list(self.inflight)
        _keep(self.received.aborted, *(obj.request_ids or ["*"]))
        for rid in ids:
            if rid in self.inflight:
                await self.engine.abort(rid)
        return JSONResponse({"status": "aborted", "aborted": len(ids)})

    async def pause(
        self,
        mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
        clear_cache: Annotated[bool, Query()] = True,
    ) -> JSONResponse:
        _keep(self.received.pauses, mode)
        self.pause_mode = mode
        if mode == "keep":
            await self.engine.pause()
            return JSONResponse({"status": "paused"})
        self.refusing = True
        if mode == "abort":
            for rid in list(self.inflight):
                await self.engine.abort(rid)
        await self.idle.wait()
        if clear_cache:
            await self._flush()
        return JSONResponse({"status": "paused"})

    async def resume(self) -> JSONResponse:
        self.received.resumes += 1
        await self.engine.resume()
        self.pause_mode, self.refusing = None, False
        return JSONResponse({"status": "resumed"})

    async def is_paused(self) -> JSONResponse:
        return JSONResponse({"is_paused": self.pause_mode is not None})

    async def collective_rpc(self, obj: CollectiveRpc) -> JSONResponse:
        workers = self.engine.info.tp  # every worker answers
        if obj.method == "update_config":
            overrides = obj.keywords.get("overrides", obj.args[0] if obj.args else {})
            unknown = set(overrides) - {"load_config", "model_config"}
            if unknown:
                return _error(
                    f"Config override '{sorted(unknown)[0]}' is not supported. Supported configs: "
                    "load_config, model_config",
                    500,
                )
            self.next_path = str((overrides.get("model_config") or {}).get("model") or self.next_path)
            return JSONResponse({"results": [None] * workers})
        if obj.method != "reload_weights":
            return _error(f"the simulator's workers have no method {obj.method!r}", 500)
        path = str(obj.keywords.get("weights_path") or self.next_path)
        if path.startswith(("/", "./", "../", "~")) and not await asyncio.to_thread(is_dir, path):
            return _error(f"Cannot find any model weights with `{path}`", 500)
        self.model_path = self.next_path = path
        _keep(self.received.reloads, path)
        return JSONResponse({"results": [None] * workers})

    async def update_weight_version(self, obj: UpdateWeightVersion) -> JSONResponse:
        self.weight_version = obj.new_version
        _keep(self.received.versions, obj.new_version)
        # The simulator labels outputs by its core's weights: relabel them, keeping the KV (a reload does).
        await self.engine.prepare_weights(obj.new_version, Incoming.disk(None))
        await self.engine.commit_weights(obj.new_version, flush_cache=False)
        return JSONResponse({"success": True, "new_version": obj.new_version})

    # The weight-transfer engine (entrypoints/rl/online/api_router.py, v1/worker/gpu_worker.py's session guard)

    async def init_weight_transfer_engine(self, obj: InitWeightTransfer) -> JSONResponse:
        try:
            info = NCCLInitInfo(**obj.init_info)
        except ValueError as e:
            return _error(f"Invalid init_info: {e}", 500)
        if info.master_address is None or info.master_port is None:
            return _error("the simulator joins by master_address and master_port, not an NCCL unique id", 500)
        if self.transfer is not None:
            await self.transfer.leave()
        try:
            self.transfer = await Member.join(
                info.master_address, info.master_port, info.rank_offset, info.world_size, "gloo", GROUP
            )
        except Exception as e:
            self.transfer = None
            return _error(f"init_weight_transfer_engine failed: {e}", 500)
        self.transfer_info = info
        return JSONResponse({"message": "Weight transfer initialized"})

    async def start_weight_update(self) -> JSONResponse:
        if self.updating:
            return _error("start_weight_update was already called: a weight update is in progress", 500)
        self.updating = True
        return JSONResponse({"message": "Weight update started"})

    async def update_weights(self, obj: UpdateWeights) -> JSONResponse:
        if not self.updating:
            return _error("start_weight_update must be called before update_weights", 500)
        if self.transfer is None or self.transfer_info is None:
            return _error("the weight transfer engine is not initialized", 500)
        try:
            info = NCCLUpdateInfo(**obj.update_info)
            tensors = specs(info.names, info.dtype_names, info.shapes)
        except ValueError as e:
            self.updating = False  # a failed update ends the session
            return _error(f"Invalid update_info: {e}", 500)
        packed = self.transfer_info.packed
        try:
            await self.transfer.take(
                tensors, "vllm" if packed else "per_tensor", self.transfer_info.packed_buffer_size_bytes
            )
        except Exception as e:
            self.updating = False
            return _error(f"update_weights failed: {e}", 500)
        return JSONResponse({"message": "Weights updated"})

    async def finish_weight_update(self, obj: FinishWeightUpdate | None = None) -> JSONResponse:
        if not self.updating:
            return _error("finish_weight_update was called without a matching start_weight_update", 500)
        self.updating = False
        if self.transfer is not None:
            try:
                await self.transfer.check()  # the simulator's own check: every byte against the trainer's CRC
            except Exception as e:
                return _error(f"weights received corrupt: {e}", 500)
        version = (obj or FinishWeightUpdate()).weight_version
        if version is not None:
            await self.update_weight_version(UpdateWeightVersion(new_version=version))
            _keep(self.received.transferred, version)
        return JSONResponse({"message": "Weight update finished"})

    async def shutdown_weight_transfer_engine(self) -> JSONResponse:
        if self.transfer is not None:
            self.received_bytes += self.transfer.bytes
            await self.transfer.leave()
        self.transfer, self.transfer_info = None, None
        return JSONResponse({"message": "Weight transfer engine shut down"})

    async def weight_info(self) -> JSONResponse:
        return JSONResponse({"weight_version": self.weight_version})

    async def reset_prefix_cache(
        self,
        reset_running_requests: Annotated[bool, Query()] = False,
        reset_external: Annotated[bool, Query()] = False,
    ) -> JSONResponse:
        if not reset_running_requests and self.engine.load().running:
            return JSONResponse({"success": False})  # blocks are held by running requests
        await self._flush()
        _keep(self.received.cache_resets, reset_running_requests)
        return JSONResponse({"success": True})

    async def _flush(self) -> None:
        """Drop every cached prefix; the running requests go back to the queue and recompute their context,
        as vLLM preempts them. The core does exactly this when it switches weights, so it switches to the
        weights it has."""
        label = self.engine.core.weight_version
        await self.engine.prepare_weights(label, Incoming.disk(None))
        await self.engine.commit_weights(label, flush_cache=True)
        self.keys.clear()

    # Information

    async def health(self) -> Response:
        return Response(status_code=200)

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": VLLM_VERSION})

    async def models(self) -> JSONResponse:
        card = {
            "id": self.served,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model_path,
            "parent": None,
            "max_model_len": self.max_model_len,
            "permission": [],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def server_info(
        self, config_format: Annotated[Literal["text", "json"], Query()] = "text"
    ) -> JSONResponse:
        info = self.engine.info
        config = {
            "model_config": {
                "model": self.model_path,
                "served_model_name": self.served,
                "runner": "generate",
                "max_model_len": self.max_model_len,
                "max_logprobs": MAX_LOGPROBS,
                "logprobs_mode": self.logprobs_mode,
            },
            "cache_config": {
                "block_size": BLOCK_SIZE,
                "num_gpu_blocks": self.capacity // BLOCK_SIZE,
                "kv_cache_size_tokens": self.capacity,
                "enable_prefix_caching": True,
            },
            "parallel_config": {"tensor_parallel_size": info.tp, "data_parallel_size": 1},
            "scheduler_config": {"policy": "priority", "max_num_seqs": info.max_running},
        }
        body = {
            "vllm_config": config if config_format == "json" else str(config),
            "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
            "system_env": {},
        }
        return JSONResponse(body)

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(self.engine), media_type=CONTENT_TYPE_LATEST)

    async def loom_received(self) -> Received:
        return self.received


def sim_engine(model: str, gpu: str, tp: int, clock: Clock, max_running: int = 256) -> SimEngine:
    """The simulated engine as a vLLM server schedules: priorities order the queue but preempt a running
    request only when KV runs out (v1/core/sched/scheduler.py), not for a gap in priority as SGLang does."""
    engine = SimEngine(model=model, gpu=gpu, tp=tp, clock=clock, max_running=max_running)
    engine.core.preempt_threshold = None
    return engine


def build_app(engine: SimEngine, options: Options | None = None) -> FastAPI:
    """vLLM's HTTP API over ``engine``, which the caller starts and closes."""
    server = _SimServer(engine, options or Options())
    app = FastAPI(title="Loom simulated engine (vLLM-compatible)")
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/abort_requests", server.abort_requests, methods=["POST"])
    app.add_api_route("/pause", server.pause, methods=["POST"])
    app.add_api_route("/resume", server.resume, methods=["POST"])
    app.add_api_route("/is_paused", server.is_paused, methods=["GET"])
    app.add_api_route("/collective_rpc", server.collective_rpc, methods=["POST"])
    app.add_api_route("/update_weight_version", server.update_weight_version, methods=["POST"])
    app.add_api_route("/weight_info", server.weight_info, methods=["GET"])
    app.add_api_route("/init_weight_transfer_engine", server.init_weight_transfer_engine, methods=["POST"])
    app.add_api_route("/start_weight_update", server.start_weight_update, methods=["POST"])
    app.add_api_route("/update_weights", server.update_weights, methods=["POST"])
    app.add_api_route("/finish_weight_update", server.finish_weight_update, methods=["POST"])
    app.add_api_route(
        "/shutdown_weight_transfer_engine", server.shutdown_weight_transfer_engine, methods=["POST"]
    )
    app.add_api_route("/reset_prefix_cache", server.reset_prefix_cache, methods=["POST"])
    app.add_api_route("/server_info", server.server_info, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_api_route("/loom/received", server.loom_received, methods=["GET"])
    return app


def generation_defaults(path: str | Path) -> dict[str, float]:
    """What vLLM takes from a checkpoint's generation_config.json (``path``: the file or its directory) as the
    sampling of every field a request leaves out: the values it sets, of the fields vLLM reads."""
    p = Path(path)
    config = json.loads((p / "generation_config.json" if p.is_dir() else p).read_text())
    return {k: config[k] for k in OPENAI_DEFAULTS if config.get(k) is not None}


async def serve(host: str, port: int, model: str, gpu: str, tp: int, speed: float, options: Options) -> None:
    """Run the simulated engine behind vLLM's API until SIGTERM or SIGINT; port 0 picks a free port."""
    engine = sim_engine(model, gpu, tp, Clock(speed))
    await serve_engine(engine, build_app(engine, options), host, port, "vLLM", speed)


def prompt_logprobs(ids: list[int], k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the first position, then per position the prompt's token and the
    top ``k`` as {token id: {logprob, rank, decoded_token}}."""
    table: list[dict[str, dict[str, Any]] | None] = [None]
    for prev, t in itertools.pairwise(ids):
        lp, row = raw_logprob(prev, t), raw_top(prev, k)
        ranked = {a: r for r, (a, _) in enumerate(row, 1)}
        entry = {str(t): {"logprob": lp, "rank": ranked.get(t, k + 1), "decoded_token": None}}
        for a, alp in row:
            entry.setdefault(str(a), {"logprob": alp, "rank": ranked[a], "decoded_token": None})
        table.append(entry)
    return table


def _keep(record: list[Any], *items: Any) -> None:
    record.extend(items)
    del record[:-RECEIVED_KEPT]


def _error(message: str, status: int, param: str | None = None) -> JSONResponse:
    """vLLM's ErrorResponse (entrypoints/serve/engine/protocol.py), with its type names for the status."""
    kinds = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
    body = {
        "error": {
            "message": message,
            "type": kinds.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """vLLM answers a body that does not validate with 400 (FastAPI's default is 422)."""
    return _error(str(exc), 400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return _error(str(exc.detail), exc.status_code)

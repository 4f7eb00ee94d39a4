"""``VLLMEngine``: the ``Engine`` interface over a vLLM 0.33 server's OpenAI-compatible HTTP API.

Checked against the vllm 0.33.0 wheel's own source (paths inside the package):

- generation: ``POST /v1/completions`` (entrypoints/openai/completion/api_router.py, protocol.py and
  serving.py). It takes a token-id ``prompt`` and, with ``return_token_ids``, returns ``choices[0].token_ids``;
  ``logprobs`` (0: the sampled token's only, k: k alternatives as well) with ``return_tokens_as_token_ids``
  names every token ``"token_id:N"`` in ``choices[0].logprobs`` (``token_logprobs``, ``tokens``,
  ``top_logprobs``), so no tokenizer is needed on either side; ``prompt_logprobs`` gives
  ``choices[0].prompt_logprobs``, one ``{token_id: {logprob, rank, decoded_token}}`` per prompt position, the
  first null. ``request_id`` (the engine's id is ``cmpl-<request_id>-0``), ``priority``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ``temperature``, ``top_p``, ``max_tokens`` and
  ``return_weight_versions`` (``choices[0].weight_versions``: ``{version, start, end}`` spans of output
  tokens, vllm/outputs.py WeightVersionSpan) are request fields. It is chosen over the tokens-in/tokens-out
  ``/inference/v1/generate`` because that route answers 403 unless the server runs with
  ``--enable-scale-out`` (entrypoints/scale_out/factories.py), while ``/v1/completions`` is always served and
  carries every field Loom needs. Timings come from the response's ``metrics`` (``queue_time_ms``,
  ``time_to_first_token_ms`` from scheduling to the first token, ``generation_time_ms`` after it:
  entrypoints/generate/base/serving.py build_per_request_timing_metrics) with ``--enable-per-request-metrics``,
  cached tokens from ``usage.prompt_tokens_details.cached_tokens`` with ``--enable-prompt-tokens-details``
  (entrypoints/common/cli_args.py); without them they read 0 (logged once).
- control (registered only with ``VLLM_SERVER_DEV_MODE=1``: entrypoints/launchers/api_server/routers.py):
  ``POST /abort_requests {"request_ids": [...]}`` (external ids; an empty list aborts everything, so it is
  never sent), ``POST /pause?mode=keep&clear_cache=false``, ``POST /resume``, ``GET /is_paused``,
  ``POST /update_weight_version {"new_version"}``, ``GET /weight_info`` (entrypoints/rl/online/api_router.py);
  ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}``
  (entrypoints/serve/dev/rpc/api_router.py; v1/worker/gpu_worker.py reload_weights, whose ``weights_path``
  also points ``model_config.model`` at the checkpoint: model_executor/model_loader/reload/inplace.py);
  ``POST /reset_prefix_cache?reset_running_requests=true`` (entrypoints/serve/dev/cache/api_router.py;
  v1/core/sched/scheduler.py: running requests are preempted and recompute their KV);
  ``GET /server_info?config_format=json`` (entrypoints/serve/dev/server_info/api_router.py: the VllmConfig,
  whose ``scheduler_config.policy``/``max_num_seqs``, ``cache_config.kv_cache_size_tokens``/
  ``num_gpu_blocks``/``block_size``, ``parallel_config`` and ``model_config.logprobs_mode`` are read).
- load: ``GET /metrics``, Prometheus text (v1/metrics/loggers.py): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction), ``vllm:generation_tokens_total``,
  ``vllm:prefix_cache_hits_total``/``queries_total``, ``vllm:num_preemptions_total``; ``GET /v1/models``
  (entrypoints/openai/models) for the served name and checkpoint.

Start vLLM as ``VLLM_SERVER_DEV_MODE=1 vllm serve CKPT --scheduling-policy priority --logprobs-mode
processed_logprobs --enable-per-request-metrics --enable-prompt-tokens-details``. Priority: vLLM serves LOWER
values first (v1/core/sched/request_queue.py; ties by arrival), Loom larger first, so the client sends
``-round(priority)``; without ``--scheduling-policy priority`` it sends none (and warns). vLLM preempts a
running request for priority only when KV blocks run out, never for a gap in priority as SGLang does.

Log-probabilities: ``--logprobs-mode processed_logprobs`` gives those of the distribution a token was sampled
from (after temperature and top-k/top-p); vLLM's default, ``raw_logprobs``, gives the model's before any of
that (config/model.py; start-up warns). Teacher-forced scoring (``forced_ids``) sends ``input_ids +
forced_ids`` as the prompt with ``prompt_logprobs`` and ``max_tokens`` 1, dropping the sampled token: the
log-prob at prompt position i is that of token i given the tokens before it, always of the raw distribution
(prompt tokens go through no sampling processors, whatever the mode or temperature), and such a request
prefills its whole context, since vLLM skips reading the prefix cache for it (sampling_params.py
``skip_reading_prefix_cache``).

Weights: vLLM reloads a checkpoint in place and has no separate check, so ``prepare_weights`` only records the
path and ``commit_weights`` reloads it, labels the version and resets the prefix cache, preempting the running
requests so that they recompute their context under the new weights. A reload that fails leaves vLLM's model
half loaded (layers are moved off the device before the checkpoint is read: reload/layerwise.py), so the
client reloads the checkpoint it served before and raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from loom.engine.base import NEUTRAL_SAMPLING, EngineInfo, EngineLoad, EngineOutput, EngineRequest
from loom.engine.clients.http import BROADCAST, HTTPEngine, max_model_len
from loom.engine.token_ids import QWEN3_ORDINARY, ContextIds
from loom.protocol import WeightsRef

if TYPE_CHECKING:
    from loom.weights.collective import Format

log = logging.getLogger(__name__)

# Summed over label sets, one per engine (data-parallel rank), except the KV fraction, which is averaged.
_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
)
_TOKEN_ID = "token_id:"  # return_tokens_as_token_ids names tokens so (generate/base/serving.py)


class VLLMError(RuntimeError):
    """The vLLM server could not be reached, lacks what Loom needs, or answered with an error other than a bad
    request."""


class WeightUpdateError(VLLMError):
    """vLLM could not reload a checkpoint."""


# What a request whose connection abort() closed answers: aborted, with nothing to show and no timings.
CUT: dict[str, Any] = {"choices": [{"index": 0, "finish_reason": "abort", "token_ids": []}]}


def engine_rid(rid: str) -> str:
    """The id vLLM's engine tracks a completion of ``request_id`` by, which ``/abort_requests`` takes: its
    completions route prefixes ``cmpl-`` and suffixes the prompt's index (serving.py _create_completion)."""
    return f"cmpl-{rid}-0"


class VLLMEngine(HTTPEngine):
    server = "vLLM"
    kind = "vllm"
    error = VLLMError
    # Packed (raw bytes in chunks cut by vLLM's rule: packed_tensor.py), else unpacked, a broadcast a tensor.
    weight_formats = ("vllm", "per_tensor")
    # The name vLLM serves the model by, which every completion names (read from /v1/models at start).
    served_model = ""
    # How long an aborted request may keep running before its connection is closed: /abort_requests finds only
    # a request the engine has registered, not one still being prepared nor one a proxy renamed (X-Request-Id).
    abort_grace_s = 5.0

    def __init__(
        self,
        url: str,
        model: str = "qwen3-8b",
        gpu: str = "h100",
        poll_s: float = 0.5,
        vocab: int = QWEN3_ORDINARY,
    ) -> None:
        super().__init__(url, model, gpu, poll_s, vocab)
        self._posts: dict[str, asyncio.Task[Any]] = {}  # each completion's call, by Loom's request id

    async def _handshake(self) -> None:
        models = await self._json("GET", "/v1/models")
        config = await self._server_config()
        self._configure(models, config)
        self.weight_version = str((await self._json("GET", "/weight_info")).get("weight_version") or "")
        self._paused = bool((await self._json("GET", "/is_paused")).get("is_paused"))

    async def _abort_inflight(self) -> None:
        await self._abort_wire(list(self._inflight))

    async def generate(self, req: EngineRequest) -> EngineOutput:
        key = req.prefix_key or req.rid
        ids = req.input_ids if req.input_ids is not None else self._contexts.build(key, req.input_len)
        if req.forced_ids is not None:
            out = await self._score(req, ids)
        else:
            out = self._output(req, await self._complete(req.rid, self._completion_body(req, ids)))
        if self._stale_cache and not self._inflight and not self._paused:
            await self._reset_cache(running=False)
        if req.input_ids is None:  # live requests carry the real context; replayed ones repeat this one
            # The token vLLM had to sample after a prefill-only request included: the server cached it.
            self._contexts.remember(key, ids + (out.output_ids or []))
        if req.max_new_tokens == 0:
            out.output_ids, out.output_len = [], 0
            out.output_logprobs = [] if out.output_logprobs is not None else None
            out.output_top_logprobs = [] if out.output_top_logprobs is not None else None
        return out

    async def abort(self, rid: str) -> bool:
        post = self._posts.get(rid)
        if post is None:
            return False
        # First: the cut-off holds even where /abort_requests fails.
        asyncio.get_running_loop().call_later(self.abort_grace_s, self._cut_off, rid, post)
        await self._abort_wire([rid])
        return True

    def _cut_off(self, rid: str, post: asyncio.Task[Any]) -> None:
        """Close an aborted request's connection if it still runs: vLLM cancels a request whose client went away,
        however far it got (with_cancellation), and answers nothing, so its output is lost."""
        if self._posts.get(rid) is post and not post.done():
            log.info(
                "%s: request %s outlived its abort by %gs: closing its connection",
                self.url,
                rid,
                self.abort_grace_s,
            )
            post.cancel()

    async def commit_weights(self, version: str) -> None:
        path = self._prepared(version)
        if path == BROADCAST:
            if version in self._fetched:  # a store's version, fetched while generating: broadcast it now
                await self._relay(version)
            # /finish_weight_update labelled the version; the KV the cache holds came from the old weights.
            self._committed(version, path)
            self._stale_cache = not await self._reset_cache(running=True)
            return
        failure = await self._reload(path)
        if failure is not None:
            restored = await self._reload(self.serving_path) if self.serving_path else "nothing to reload"
            state = (
                f"reloaded {self.serving_path!r}"
                if restored is None
                else f"reloading {self.serving_path!r} failed too ({restored}): its weights are undefined"
            )
            raise WeightUpdateError(
                f"{self.url} could not load {path!r} as weight version {version!r}: {failure}; {state}"
            )
        await self._json("POST", "/update_weight_version", {"new_version": version})
        self._committed(version, path)
        # Every KV block came from the old weights: the running requests recompute theirs (vLLM preempts them
        # back to the queue, keeping their tokens), later ones miss the cache.
        self._stale_cache = not await self._reset_cache(running=True)

    async def _take(self, version: str, ref: WeightsRef, fmt: Format) -> None:
        """vLLM's weight-transfer engine joins the trainer's group (``/init_weight_transfer_engine``, packed
        with the buckets' size), takes every tensor in one session (``/start_weight_update``,
        ``/update_weights``, ``/finish_weight_update`` labelling the version), and shuts down."""
        from loom.weights.collective import split_address

        host, port = split_address(ref.address)
        init = {
            "master_address": host,
            "master_port": port,
            "rank_offset": ref.rank,
            "world_size": ref.world_size,
            "packed": fmt == "vllm",
            "packed_buffer_size_bytes": ref.bucket_bytes,
            "packed_num_buffers": 2,
        }
        await self._json("POST", "/init_weight_transfer_engine", {"init_info": init})
        try:
            await self._json("POST", "/start_weight_update", {})
            update = {
                "names": [t.name for t in ref.tensors],
                "dtype_names": [t.dtype for t in ref.tensors],
                "shapes": [t.shape for t in ref.tensors],
            }
            await self._json("POST", "/update_weights", {"update_info": update})
            await self._json("POST", "/finish_weight_update", {"weight_version": version})
        finally:
            with contextlib.suppress(VLLMError, ValueError):
                await self._json("POST", "/shutdown_weight_transfer_engine", {})

    async def pause(self) -> None:
        # vLLM's default mode aborts everything in flight and "wait" drains it; "keep" freezes requests with
        # their KV and queues new ones, as the simulator's pause does. The cache is reset at the commit.
        await self._json("POST", "/pause?mode=keep&clear_cache=false")
        self._paused = True

    async def resume(self) -> None:
        await self._json("POST", "/resume")
        self._paused = False
        if self._stale_cache and not self._inflight:
            await self._reset_cache(running=False)

    # Requests

    def _completion_body(self, req: EngineRequest, ids: list[int]) -> dict[str, Any]:
        # Not streamed: the Engine interface reports only the end, and vLLM's FINAL_ONLY output is one message.
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": ids,
            # vLLM generates at least one token (SamplingParams._verify_args); a prefill-only request drops it.
            "max_tokens": max(1, req.max_new_tokens),
            "temperature": req.temperature,
            "top_p": req.top_p,
            **NEUTRAL_SAMPLING,  # vLLM fills a field left out from generation_config (Qwen3's: top_k 20)
            "ignore_eos": req.ignore_eos,
            "request_id": req.rid,
            "return_token_ids": True,
            "return_weight_versions": True,
            "stream": False,
        }
        if req.stop:
            body["stop"] = list(req.stop)  # vLLM keeps the ids through the token that completes one
        if req.stop_token_ids:
            body["stop_token_ids"] = list(req.stop_token_ids)
        if req.seed is not None:
            body["seed"] = req.seed
        if req.return_logprob or req.top_logprobs:
            body["logprobs"] = req.top_logprobs
            body["return_tokens_as_token_ids"] = True
        self._prioritize(body, req.priority)
        return body

    def _prioritize(self, body: dict[str, Any], priority: float) -> None:
        if self._priority_sign:
            # vLLM takes integers and serves lower ones first: Loom's remaining-token estimates, negated and
            # rounded, keep their order.
            body["priority"] = self._priority_sign * round(priority)

    async def _score(self, req: EngineRequest, ids: list[int]) -> EngineOutput:
        """A teacher-forced request: the forced ids' log-probs as vLLM's prompt log-probs of the context and
        the forced ids together; the one token vLLM samples after them is dropped."""
        forced = list((req.forced_ids or [])[: req.max_new_tokens])
        wanted = req.return_logprob or req.top_logprobs > 0
        if not forced:
            return EngineOutput(
                rid=req.rid,
                output_len=0,
                finish_reason="length",
                output_ids=[],
                weight_version=self.weight_version,
                output_logprobs=[] if req.return_logprob else None,
                output_top_logprobs=[] if req.top_logprobs else None,
            )
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": ids + forced,
            "max_tokens": 1,
            "request_id": req.rid,
            "return_token_ids": True,
            "return_weight_versions": True,
            "stream": False,
        }
        if wanted:
            body["prompt_logprobs"] = req.top_logprobs
        self._prioritize(body, req.priority)
        answer = await self._complete(req.rid, body)
        choice = _choice(self.url, answer)
        if choice.get("finish_reason") == "abort":
            return EngineOutput(
                rid=req.rid,
                output_len=0,
                finish_reason="abort",
                output_ids=[],
                weight_version=self.weight_version,
            )
        queue_s, prefill_s, _ = self._phases(answer)
        rows: list[list[tuple[int, float]]] = []
        if wanted:
            rows = _prompt_rows(self.url, req.rid, choice, len(ids), forced, req.top_logprobs)
        return EngineOutput(
            rid=req.rid,
            output_len=len(forced),
            finish_reason="length",
            output_ids=forced,
            queue_s=queue_s,
            prefill_s=prefill_s,
            cached_tokens=self._cached(answer),
            weight_version=_version(choice) or self.weight_version,
            output_logprobs=[row[0][1] for row in rows] if req.return_logprob else None,
            output_top_logprobs=[row[1:] for row in rows] if req.top_logprobs else None,
        )

    async def _complete(self, rid: str, body: dict[str, Any]) -> dict[str, Any]:
        self._inflight.add(rid)
        post = asyncio.create_task(self._json("POST", "/v1/completions", body), name=f"vllm-{rid}")
        self._posts[rid] = post
        try:
            answer = await post
        except asyncio.CancelledError:
            me = asyncio.current_task()
            # The call was cancelled and this task was not: only _cut_off does that.
            if post.cancelled() and me is not None and not me.cancelling():
                return CUT
            # vLLM also aborts a request whose connection closes, but only once it notices the disconnect.
            with contextlib.suppress(VLLMError, ValueError, TimeoutError):
                async with asyncio.timeout(5):
                    await self._abort_wire([rid])
            raise
        finally:
            self._inflight.discard(rid)
            if self._posts.get(rid) is post:
                del self._posts[rid]
        if not isinstance(answer, dict):
            raise VLLMError(f"{self.url}/v1/completions: not a completion: {str(answer)[:200]}")
        return answer

    async def _reload(self, path: str) -> str | None:
        """Reload the checkpoint at ``path`` into the serving model; the failure, or None."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        _, status, text = await self._request("POST", "/collective_rpc", body)
        return None if status < 300 else f"HTTP {status}: {self._message(text)}"

    async def _reset_cache(self, running: bool) -> bool:
        """Drop the prefix cache (with ``running``, also the KV of the requests running, which recompute it).
        vLLM refuses without ``running`` while requests hold blocks: the next idle moment tries again."""
        flag = "true" if running else "false"
        try:
            out = await self._json("POST", f"/reset_prefix_cache?reset_running_requests={flag}")
        except (ValueError, VLLMError) as e:
            log.warning("resetting the prefix cache of %s after a weight update: %s", self.url, e)
            return False
        ok = bool(isinstance(out, dict) and out.get("success"))
        self._stale_cache = not ok
        return ok

    # Start-up and load

    async def _server_config(self) -> dict[str, Any]:
        url, status, text = await self._request("GET", "/server_info?config_format=json")
        if status == 404:
            raise VLLMError(
                f"{self.url} has no /server_info: start vLLM with VLLM_SERVER_DEV_MODE=1 (Loom needs its "
                "/pause, /resume, /abort_requests, /collective_rpc and /reset_prefix_cache routes)"
            )
        if status >= 300:
            raise VLLMError(f"GET {url}: HTTP {status}: {self._message(text)}")
        config = json.loads(text).get("vllm_config")
        if not isinstance(config, dict):
            raise VLLMError(f"GET {url}: no vllm_config in JSON (config_format=json)")
        return config

    def _configure(self, models: dict[str, Any], config: dict[str, Any]) -> None:
        cards = models.get("data") or []
        if not cards:
            raise VLLMError(f"{self.url}/v1/models lists no model")
        model = config.get("model_config") or {}
        if model.get("runner") == "pooling":
            raise ValueError(f"{self.url} runs a pooling model, not a generation model")
        scheduler = config.get("scheduler_config") or {}
        if scheduler.get("policy") != "priority":
            log.warning("%s ignores priorities: start vLLM with --scheduling-policy priority", self.url)
            self._priority_sign = 0
        else:
            self._priority_sign = -1  # vLLM serves lower values first, Loom larger ones
        if model.get("logprobs_mode", "raw_logprobs") != "processed_logprobs":
            log.warning(
                "%s returns log-probs of the raw distribution, not the one tokens are sampled from: start "
                "vLLM with --logprobs-mode processed_logprobs",
                self.url,
            )
        cache = config.get("cache_config") or {}
        parallel = config.get("parallel_config") or {}
        per_engine = cache.get("kv_cache_size_tokens")
        if per_engine:
            capacity = int(per_engine) * int(parallel.get("data_parallel_size") or 1)
        else:  # num_gpu_blocks is summed over data-parallel engines already (v1/engine/core_client.py)
            capacity = int(cache.get("num_gpu_blocks") or 0) * int(cache.get("block_size") or 0)
        if capacity <= 0:
            raise VLLMError(f"{self.url} reports no KV cache size in /server_info")
        self.served_model = str(cards[0]["id"])
        self.serving_path = str(cards[0].get("root") or model.get("model") or "")
        self.info = EngineInfo(
            kind="vllm",
            model=self.info.model,
            gpu=self.info.gpu,
            tp=int(parallel.get("tensor_parallel_size") or 1),
            max_running=int(scheduler.get("max_num_seqs") or 0),
            kv_capacity_tokens=capacity,
            max_context_tokens=max_model_len(self.url, models),
        )
        self._contexts = ContextIds(capacity, self.vocab)

    async def _poll_once(self) -> EngineLoad:
        totals: dict[str, float] = defaultdict(float)
        engines = 0
        for family in text_string_to_metric_families(await self._text("GET", "/metrics")):
            for sample in family.samples:
                if sample.name in _METRICS:
                    totals[sample.name] += sample.value
                    engines += sample.name == "vllm:kv_cache_usage_perc"
        usage = totals["vllm:kv_cache_usage_perc"] / max(engines, 1)
        capacity = self.info.kv_capacity_tokens
        queries = totals["vllm:prefix_cache_queries_total"]
        return EngineLoad(
            running=int(totals["vllm:num_requests_running"]),
            waiting=int(totals["vllm:num_requests_waiting"]),
            kv_used_tokens=round(usage * capacity),
            kv_capacity_tokens=capacity,
            generated_tokens=int(totals["vllm:generation_tokens_total"]),
            extra={
                "token_usage": usage,
                "cache_hit_rate": totals["vllm:prefix_cache_hits_total"] / queries if queries else 0.0,
                "preemptions": totals["vllm:num_preemptions_total"],
            },
        )

    # Responses

    def _output(self, req: EngineRequest, answer: dict[str, Any]) -> EngineOutput:
        choice = _choice(self.url, answer)
        reason = choice.get("finish_reason")
        # vLLM's other reasons ("stop", and "repetition" for a detected loop) end the output before its length.
        finish: Literal["length", "stop", "abort"] = reason if reason in ("length", "abort") else "stop"
        output_ids = choice.get("token_ids")
        if not isinstance(output_ids, list):
            raise VLLMError(
                f"{self.url}: request {req.rid!r} got no token_ids: vLLM too old for return_token_ids"
            )
        logprobs = choice.get("logprobs")
        rows: list[list[tuple[int, float]]] | None = None
        if req.return_logprob or req.top_logprobs:
            if logprobs is None and finish != "abort":
                raise VLLMError(f"{self.url}: request {req.rid!r} asked for log-probs and got none")
            if logprobs is not None:
                rows = _sampled_rows(self.url, req.rid, logprobs, output_ids, req.top_logprobs)
        queue_s, prefill_s, decode_s = self._phases(answer)
        return EngineOutput(
            rid=req.rid,
            output_len=len(output_ids),
            finish_reason=finish,
            output_ids=output_ids,
            queue_s=queue_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            cached_tokens=self._cached(answer),
            weight_version=_version(choice) or self.weight_version,
            output_logprobs=[row[0][1] for row in rows] if rows is not None and req.return_logprob else None,
            output_top_logprobs=[row[1:] for row in rows] if rows is not None and req.top_logprobs else None,
        )

    def _phases(self, answer: dict[str, Any]) -> tuple[float, float, float]:
        """Queue, prefill and decode seconds from the response's per-request metrics."""
        metrics = answer.get("metrics") or {}
        if "queue_time_ms" not in metrics and answer is not CUT:
            self._warn_once(
                "metrics", "%s sends no per-request timings: start vLLM with --enable-per-request-metrics"
            )
        return (
            float(metrics.get("queue_time_ms") or 0.0) / 1000,
            float(metrics.get("time_to_first_token_ms") or 0.0) / 1000,
            float(metrics.get("generation_time_ms") or 0.0) / 1000,
        )

    def _cached(self, answer: dict[str, Any]) -> int:
        details = (answer.get("usage") or {}).get("prompt_tokens_details")
        if details is None:
            if answer is not CUT:
                self._warn_once(
                    "cached",
                    "%s sends no cached-token counts: start vLLM with --enable-prompt-tokens-details",
                )
            return 0
        return int(details.get("cached_tokens") or 0)

    # HTTP

    async def _abort_wire(self, rids: list[str]) -> None:
        await self._json("POST", "/abort_requests", {"request_ids": [engine_rid(r) for r in rids]})


def _choice(url: str, answer: dict[str, Any]) -> dict[str, Any]:
    choices = answer.get("choices")
    if not choices or not isinstance(choices[0], dict):
        raise VLLMError(f"{url}/v1/completions: no choices in {str(answer)[:200]}")
    return choices[0]


def _version(choice: dict[str, Any]) -> str:
    """The weight version that sampled the last output token (``weight_versions``' last span)."""
    spans = choice.get("weight_versions") or []
    return str(spans[-1].get("version") or "") if spans else ""


def _token_id(url: str, token: str) -> int:
    if not token.startswith(_TOKEN_ID):
        raise VLLMError(f"{url}: token {token!r} is not named by its id (return_tokens_as_token_ids)")
    return int(token.removeprefix(_TOKEN_ID))


def _sampled_rows(
    url: str, rid: str, logprobs: dict[str, Any], output_ids: list[int], k: int
) -> list[list[tuple[int, float]]]:
    """Per output token: (its id, its log-prob), then its ``k`` most likely alternatives, from vLLM's
    completion logprobs (``tokens``, ``token_logprobs`` and ``top_logprobs``: the sampled token and the top k,
    k + 1 entries where the sampled one is not among them, keyed ``"token_id:N"``)."""
    tokens = [_token_id(url, t) for t in logprobs.get("tokens") or ()]
    values = logprobs.get("token_logprobs") or []
    if tokens != output_ids or len(values) != len(tokens) or any(v is None for v in values):
        raise VLLMError(
            f"{url}: the {len(values)} log-probs of request {rid!r} are not those of its {len(output_ids)} "
            "output ids"
        )
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    rows: list[list[tuple[int, float]]] = []
    for t, lp, top in zip(tokens, values, tops, strict=True):
        alts = sorted(((_token_id(url, n), float(v)) for n, v in (top or {}).items()), key=lambda e: -e[1])
        rows.append([(t, float(lp)), *alts[:k]])
    return rows


def _prompt_rows(
    url: str, rid: str, choice: dict[str, Any], start: int, forced: list[int], k: int
) -> list[list[tuple[int, float]]]:
    """Per forced token: (its id, its log-prob given everything before it), then the ``k`` most likely
    tokens at its position, from vLLM's ``prompt_logprobs`` (one dict per prompt position, keyed by token id,
    the first null; each holds the prompt's token and the top k)."""
    table = choice.get("prompt_logprobs")
    if not isinstance(table, list) or len(table) != start + len(forced):
        raise VLLMError(
            f"{url}: request {rid!r} asked for the prompt log-probs of {start + len(forced)} tokens and got "
            f"{len(table) if isinstance(table, list) else 'none'}"
        )
    rows: list[list[tuple[int, float]]] = []
    for i, t in enumerate(forced):
        position = table[start + i] or {}
        entry = position.get(str(t))
        if entry is None:
            raise VLLMError(f"{url}: request {rid!r} has no prompt log-prob of token {t} at {start + i}")
        alts = sorted(((int(n), float(v["logprob"])) for n, v in position.items()), key=lambda e: -e[1])
        rows.append([(t, float(entry["logprob"])), *alts[:k]])
    return rows

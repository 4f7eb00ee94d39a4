"""``SGLangEngine``: the ``Engine`` interface over a real SGLang server's native HTTP API.

The server must run with ``--enable-metrics`` (load figures come from its Prometheus ``/metrics``) and,
for Loom's queue order to reach the GPU, ``--enable-priority-scheduling``. Start-up reads both settings
from ``/get_server_info`` and fails, or warns, when they are missing.

Log-probabilities (``return_logprob``) are SGLang's ``meta_info.output_token_logprobs``: by default those of
the distribution the token was sampled from after temperature scaling (``log_softmax(logits / T)``, before
top-p/top-k truncation); a server started with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` returns those of the raw
logits instead (python/sglang/srt/layers/sampler.py upstream). ``top_logprobs`` is SGLang's
``top_logprobs_num``, read back from ``meta_info.output_top_logprobs``. ``stop`` and ``stop_token_ids`` go in
the sampling params as SGLang names them: it ends the output at the token that completes a stop string or is
a stop id, and keeps that token in ``output_ids``. A teacher-forced request (``forced_ids``) is a prefill-only
request whose input log-probs are the forced reply's (``_forced``).

Weights: SGLang loads a checkpoint in place (``/update_weights_from_disk``) and has no separate check, so
``prepare_weights`` only records the path and ``commit_weights`` loads it; a load that fails keeps the old
weights (SGLang rolls back) and raises with SGLang's message. ``serving_path`` and ``previous_path`` let a
fleet that committed part of its workers load the old checkpoint back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from loom.engine.base import NEUTRAL_SAMPLING, EngineInfo, EngineLoad, EngineOutput, EngineRequest
from loom.engine.clients.http import BROADCAST, HTTPEngine, max_model_len
from loom.engine.token_ids import ContextIds
from loom.protocol import WeightsRef
from loom.weights import GROUP

if TYPE_CHECKING:
    from loom.weights.collective import Format

log = logging.getLogger(__name__)

# Summed over label sets, one per DP rank: right for counts and throughput; the hit rate assumes one rank.
# SGLang disables top_k with -1 only (0 is refused); its /generate fills a field left out from the server's
# --preferred-sampling-params.
NEUTRAL = {**NEUTRAL_SAMPLING, "top_k": -1}
_METRICS = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_used_tokens",
    "sglang:generation_tokens_total",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
)


class SGLangError(RuntimeError):
    """The SGLang server could not be reached, or answered with an error other than a bad request."""


class WeightUpdateError(SGLangError):
    """SGLang could not load a checkpoint (``success`` false); it keeps serving the weights it had."""


def wire_rid(rid: str) -> str:
    """The rid sent to SGLang. Its scheduler aborts every queued request whose rid *starts with* the one
    given, so rids must be prefix-free ("a.1" would take "a.10" with it); a length prefix makes them so."""
    return f"{len(rid)}:{rid}"


class SGLangEngine(HTTPEngine):
    server = "SGLang"
    kind = "sglang"
    error = SGLangError
    # One /update_weights_from_distributed a bucket (load_format "flattened_bucket"), else one for all.
    weight_formats = ("buckets", "per_tensor")

    async def _handshake(self) -> None:
        model = await self._json("GET", "/get_model_info")
        server = await self._json("GET", "/get_server_info")
        self._configure(model, server)
        # The context length SGLang serves (--context-length, else the model's): /v1/models' max_model_len.
        limit = max_model_len(self.url, await self._json("GET", "/v1/models"))
        self.info = dataclasses.replace(self.info, max_context_tokens=limit)

    async def _abort_inflight(self) -> None:
        for rid in list(self._inflight):
            with contextlib.suppress(SGLangError):
                await self._abort_wire(rid)

    async def generate(self, req: EngineRequest) -> EngineOutput:
        key = req.prefix_key or req.rid
        ids = req.input_ids if req.input_ids is not None else self._contexts.build(key, req.input_len)
        rid = wire_rid(req.rid)
        if req.forced_ids is not None:
            return await self._forced(req, ids, rid)
        # Not streamed: SGLang's stream resends every token so far in each chunk (quadratic in the output)
        # unless started with --incremental-streaming-output, and the Engine interface reports only the end.
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": req.max_new_tokens,
                "ignore_eos": req.ignore_eos,
                "temperature": req.temperature,
                "top_p": req.top_p,
                **NEUTRAL,
            },
            "stream": False,
        }
        params = body["sampling_params"]
        if req.stop:
            params["stop"] = list(req.stop)  # SGLang keeps the ids through the token that completes one
        if req.stop_token_ids:
            params["stop_token_ids"] = list(req.stop_token_ids)
        if req.seed is not None:
            params["sampling_seed"] = req.seed
        if req.return_logprob or req.top_logprobs:
            # logprob_start_len left at SGLang's default (-1): the output tokens' only.
            body["return_logprob"] = True
        if req.top_logprobs:
            body["top_logprobs_num"] = req.top_logprobs
        if self._priority_sign:
            # SGLang takes integers; Loom's priorities are remaining-token estimates, so rounding is lossless
            # for ordering. (SGLang preempts a running request only for a priority higher by more than
            # --priority-scheduling-preemption-threshold, 10 by default.)
            body["priority"] = self._priority_sign * round(req.priority)
        out = await self._post_generate(rid, body)
        result = self._output(req.rid, out, req.return_logprob, req.top_logprobs)
        if req.input_ids is None:  # live requests carry the real context; replayed ones repeat this one
            self._contexts.remember(key, ids + (result.output_ids or []))
        return result

    async def _post_generate(self, rid: str, body: dict[str, Any]) -> Any:
        self._inflight.add(rid)
        try:
            out = await self._json("POST", "/generate", body)
        except asyncio.CancelledError:
            with contextlib.suppress(SGLangError, TimeoutError):
                async with asyncio.timeout(5):
                    await self._abort_wire(rid)
            raise
        finally:
            self._inflight.discard(rid)
        if self._stale_cache and not self._inflight and not self._paused:
            await self._flush_stale_cache()
        return out

    async def _forced(self, req: EngineRequest, ids: list[int], rid: str) -> EngineOutput:
        """Teacher forcing as SGLang scores a text: a prefill-only request (``max_new_tokens`` 0) of the context
        and the forced reply, whose ``input_token_logprobs`` from ``logprob_start_len`` = the context's last
        position on are the reply's (the first entry, that position's own, has none). They are temperature-
        scaled as sampled tokens' are (the logits processor's ``compute_temp_top_p_normalized_logprobs``)."""
        assert req.forced_ids is not None
        forced = list(req.forced_ids[: req.max_new_tokens])
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": ids + forced,
            "sampling_params": {
                "max_new_tokens": 0,
                "temperature": req.temperature,
                "top_p": req.top_p,
                **NEUTRAL,
            },
            "return_logprob": True,
            "logprob_start_len": len(ids) - 1,
            "stream": False,
        }
        if req.top_logprobs:
            body["top_logprobs_num"] = req.top_logprobs
        if self._priority_sign:
            body["priority"] = self._priority_sign * round(req.priority)
        out = await self._post_generate(rid, body)
        meta = out["meta_info"]
        queue_s, prefill_s, decode_s = _phases(meta)
        result = EngineOutput(
            rid=req.rid,
            output_len=len(forced),
            finish_reason="length",
            output_ids=forced,
            queue_s=queue_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version") or self.weight_version),
        )
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            result.finish_reason, result.output_len, result.output_ids = "abort", 0, []
            return result
        triples = meta.get("input_token_logprobs") or []
        if [int(t[1]) for t in triples] != [ids[-1], *forced]:
            raise SGLangError(
                f"{self.url}: the input log-probs of request {rid!r} are not those of its forced reply"
            )
        if req.return_logprob:
            result.output_logprobs = [float(t[0]) for t in triples[1:]]
        if req.top_logprobs:
            # A row per position from logprob_start_len; the first (the context's last position) may be left out.
            rows = list(meta.get("input_top_logprobs") or [])
            if len(rows) == len(triples):
                rows = rows[1:]
            if len(rows) != len(forced):
                raise SGLangError(
                    f"{self.url}: request {rid!r} got no input_top_logprobs for its forced reply"
                )
            result.output_top_logprobs = [[(int(t[1]), float(t[0])) for t in row or ()] for row in rows]
        return result

    async def abort(self, rid: str) -> bool:
        wire = wire_rid(rid)
        if wire not in self._inflight:
            return False
        await self._abort_wire(wire)
        return True

    async def commit_weights(self, version: str) -> None:
        path = self._prepared(version)
        if path == BROADCAST:
            if version in self._fetched:  # a store's version, fetched while generating: broadcast it now
                await self._relay(version)
            self._committed(version, path)
            return
        # SGLang's flush after the load needs an idle scheduler: paused in place with requests running, it
        # fails and the scheduler dies on an assertion. Not paused, SGLang waits for the requests in flight
        # to finish before it loads, so the flush finds it idle. The requests a paused update leaves
        # running keep the KV of their context from the old weights (SGLang does not recompute it).
        flush = not (self._paused and self._inflight)
        body = {
            "model_path": path,
            "weight_version": version,  # every response's meta_info carries it from now on
            "abort_all_requests": False,  # requests in flight continue under the new weights
            "flush_cache": flush,
        }
        status, out = await self._answer("POST", "/update_weights_from_disk", body)
        if not (isinstance(out, dict) and out.get("success")):
            message = out.get("message") if isinstance(out, dict) else out
            raise WeightUpdateError(
                f"{self.url} could not load {path!r} as weight version {version!r} (HTTP {status}): {message}"
            )
        self._committed(version, path)
        self._stale_cache = self._stale_cache or not flush

    async def _take(self, version: str, ref: WeightsRef, fmt: Format) -> None:
        """SGLang joins the trainer's group (``/init_weights_update_group``), takes the tensors through
        ``/update_weights_from_distributed`` (``buckets``: one flattened bucket a request; ``per_tensor``: one
        request, a broadcast a tensor), loading them in place, the version labelled and the cache flushed with
        the last, and leaves it."""
        from loom.weights import manifest
        from loom.weights.collective import split_address

        host, port = split_address(ref.address)
        group = {"group_name": GROUP}
        await self._update(
            "/init_weights_update_group",
            {
                "master_address": host,
                "master_port": port,
                "rank_offset": ref.rank,
                "world_size": ref.world_size,
                "backend": ref.backend,
                **group,
            },
        )
        # As at a checkpoint's commit: paused in place with requests running, SGLang's flush would fail.
        flush = not (self._paused and self._inflight)
        try:
            if fmt == "buckets":
                parts = [(b.first, b.last) for b in manifest.buckets(ref.tensors, ref.bucket_bytes)]
            else:
                parts = [(0, len(ref.tensors))]
            for i, (first, end) in enumerate(parts):
                part, last = ref.tensors[first:end], i == len(parts) - 1
                body = {
                    "names": [t.name for t in part],
                    "dtypes": [t.dtype for t in part],
                    "shapes": [t.shape for t in part],
                    "flush_cache": flush and last,
                    "abort_all_requests": False,
                    "weight_version": version if last else None,
                    "load_format": "flattened_bucket" if fmt == "buckets" else None,
                    **group,
                }
                await self._update("/update_weights_from_distributed", body)
        finally:
            with contextlib.suppress(SGLangError, WeightUpdateError, ValueError):
                await self._update("/destroy_weights_update_group", group)
        self._stale_cache = self._stale_cache or not flush

    async def _update(self, path: str, body: dict[str, Any]) -> None:
        status, out = await self._answer("POST", path, body)
        if not (isinstance(out, dict) and out.get("success")):
            message = out.get("message") if isinstance(out, dict) else out
            raise WeightUpdateError(f"{self.url}{path} (HTTP {status}): {message}")

    async def pause(self) -> None:
        # SGLang's default mode aborts everything in flight; "in_place" keeps requests and their KV, as the
        # simulator's pause does. (Servers older than the mode field ignore it and abort.)
        await self._json("POST", "/pause_generation", {"mode": "in_place"})
        self._paused = True

    async def resume(self) -> None:
        await self._json("POST", "/continue_generation", {})
        self._paused = False
        if self._stale_cache and not self._inflight:
            await self._flush_stale_cache()

    async def _flush_stale_cache(self) -> None:
        """Drop the radix cache computed by old weights. SGLang refuses (HTTP 400) unless it is idle, as it
        is not if another request came in meanwhile: then the next idle moment tries again."""
        try:
            await self._text("POST", "/flush_cache")
        except (ValueError, SGLangError) as e:
            log.debug("flushing %s after a weight update: %s", self.url, e)
            return
        self._stale_cache = False

    # Start-up and load

    def _configure(self, model: dict[str, Any], server: dict[str, Any]) -> None:
        if not model.get("is_generation", True):
            raise ValueError(f"{self.url} serves an embedding model, not a generation model")
        if not server.get("enable_metrics"):
            raise SGLangError(f"{self.url} has no load metrics: start SGLang with --enable-metrics")
        if not server.get("enable_priority_scheduling"):
            log.warning("%s ignores priorities: start SGLang with --enable-priority-scheduling", self.url)
        else:
            # SGLang serves larger values first unless --schedule-low-priority-values-first, as Loom does.
            self._priority_sign = -1 if server.get("schedule_low_priority_values_first") else 1
        states = server.get("internal_states") or [{}]
        max_running = states[0].get("effective_max_running_requests_per_dp") or server["max_running_requests"]
        capacity = int(server["max_total_num_tokens"])
        self.info = EngineInfo(
            kind="sglang",
            model=self.info.model,
            gpu=self.info.gpu,
            tp=int(server.get("tp_size", 1)),
            max_running=int(max_running),
            kv_capacity_tokens=capacity,
        )
        self.weight_version = str(model.get("weight_version") or "")
        self.serving_path = str(model.get("model_path") or "")
        self._contexts = ContextIds(capacity, self.vocab)

    async def _poll_once(self) -> EngineLoad:
        totals: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(await self._text("GET", "/metrics")):
            for sample in family.samples:
                if sample.name in _METRICS:
                    totals[sample.name] += sample.value
        used = int(totals["sglang:num_used_tokens"])
        capacity = self.info.kv_capacity_tokens
        return EngineLoad(
            running=int(totals["sglang:num_running_reqs"]),
            waiting=int(totals["sglang:num_queue_reqs"]),
            kv_used_tokens=used,
            kv_capacity_tokens=capacity,
            generated_tokens=int(totals["sglang:generation_tokens_total"]),
            extra={
                "gen_throughput": totals["sglang:gen_throughput"],
                "cache_hit_rate": totals["sglang:cache_hit_rate"],
                "token_usage": used / capacity if capacity else 0.0,
            },
        )

    # Responses

    def _output(self, rid: str, out: dict[str, Any], logprobs: bool = False, top: int = 0) -> EngineOutput:
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        finish: Literal["length", "stop", "abort"] = reason if reason in ("length", "abort") else "stop"
        output_ids = out.get("output_ids")
        queue_s, prefill_s, decode_s = _phases(meta)
        output_logprobs = _logprobs(self.url, rid, meta, output_ids) if logprobs else None
        return EngineOutput(
            rid=rid,
            output_len=int(meta.get("completion_tokens", len(output_ids or ()))),
            finish_reason=finish,
            output_ids=output_ids,
            queue_s=queue_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            cached_tokens=int(meta.get("cached_tokens", 0)),
            weight_version=str(meta.get("weight_version") or self.weight_version),
            output_logprobs=output_logprobs,
            output_top_logprobs=_top_logprobs(self.url, rid, meta, output_ids) if top else None,
        )

    # HTTP

    async def _abort_wire(self, rid: str) -> None:
        await self._json("POST", "/abort_request", {"rid": rid})

    async def _answer(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Status and JSON body of an endpoint that reports failure in its body (``success``, ``message``),
        with HTTP 400, as SGLang's weight updates do."""
        url, status, text = await self._request(method, path, body)
        try:
            return status, json.loads(text)
        except ValueError:
            if status >= 300:
                raise SGLangError(f"{method} {url}: HTTP {status}: {text.strip()}") from None
            raise SGLangError(f"{method} {url}: not JSON: {text.strip()[:200]}") from None


def _phases(meta: dict[str, Any]) -> tuple[float, float, float]:
    """Queue, prefill and decode seconds from SGLang's meta_info.

    With --enable-metrics SGLang reports ``inference_time`` (from the first forward pass to the end) and
    ``decode_throughput`` ((completion_tokens - 1) / time after the first token) beside ``e2e_latency``;
    whatever is missing is counted as prefill, so the three always add up to the end-to-end latency."""
    e2e = float(meta.get("e2e_latency") or 0.0)
    queue = max(0.0, e2e - float(meta["inference_time"])) if "inference_time" in meta else 0.0
    tokens = int(meta.get("completion_tokens") or 0)
    throughput = float(meta.get("decode_throughput") or 0.0)
    decode = (tokens - 1) / throughput if throughput > 0 and tokens > 1 else 0.0
    decode = min(decode, e2e - queue)
    return queue, e2e - queue - decode, decode


def _logprobs(url: str, rid: str, meta: dict[str, Any], output_ids: list[int] | None) -> list[float] | None:
    """The log-probability of each output token, from SGLang's ``output_token_logprobs``: one
    [logprob, token_id, text or null] triple per output token, in order."""
    triples = meta.get("output_token_logprobs")
    if triples is None:
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None  # aborted before SGLang attached any
        raise SGLangError(f"{url}: request {rid!r} asked for log-probs and got no output_token_logprobs")
    ids = [int(t[1]) for t in triples]
    if output_ids is not None and ids != output_ids:
        raise SGLangError(
            f"{url}: the {len(ids)} log-probs of request {rid!r} are not those of its {len(output_ids)} "
            "output ids"
        )
    return [float(t[0]) for t in triples]


def _top_logprobs(
    url: str, rid: str, meta: dict[str, Any], output_ids: list[int] | None
) -> list[list[tuple[int, float]]] | None:
    """Each output token's alternatives, from SGLang's ``output_top_logprobs``: per output token, a list of
    [logprob, token_id, text or null], most likely first."""
    rows = meta.get("output_top_logprobs")
    if rows is None:
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None
        raise SGLangError(f"{url}: request {rid!r} asked for top log-probs and got no output_top_logprobs")
    if output_ids is not None and len(rows) != len(output_ids):
        raise SGLangError(
            f"{url}: {len(rows)} rows of top log-probs for the {len(output_ids)} output ids of request {rid!r}"
        )
    return [[(int(t[1]), float(t[0])) for t in row or ()] for row in rows]

"""The vLLM client against the vLLM-compatible server over the simulated engine, over real HTTP; then a rollout
worker driving that server over NATS, as it would drive a real vLLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from nats.aio.client import Client as NATS

from loom.clock import Clock
from loom.engine.clients.vllm import VLLMEngine, VLLMError, WeightUpdateError, engine_rid
from loom.engine.fakes.vllm_server import Options, build_app, sim_engine
from loom.runtime.service import Runtime
from loom.weights import Incoming
from services.rollout.__main__ import make_engine
from services.rollout.settings import RolloutSettings
from tests import sim_servers
from tests.conftest import Services
from tests.integration.helpers import until
from tests.sim_servers import request as _req
from tests.sim_servers import served_through_the_router, started

SPEED = 500.0
MODEL = "qwen3-0.6b"


class SimServer(sim_servers.SimServer):
    """The vLLM-compatible server on a free port, uvicorn in-process, over a sped-up simulated engine."""

    def __init__(
        self, max_running: int = 64, app: FastAPI | None = None, options: Options | None = None
    ) -> None:
        engine = sim_engine(MODEL, "h100", 1, Clock(SPEED), max_running=max_running)
        super().__init__(engine, app or build_app(engine, options))

    async def received(self) -> dict[str, Any]:
        return await _get(self.url + "/loom/received")  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def _backend(max_running: int = 64) -> AsyncIterator[tuple[SimServer, VLLMEngine]]:
    async with (
        SimServer(max_running) as server,
        started(VLLMEngine(server.url, model=MODEL, poll_s=0.05)) as c,
    ):
        yield server, c


@pytest.fixture
async def backend() -> AsyncIterator[tuple[SimServer, VLLMEngine]]:
    async with _backend() as pair:
        yield pair


async def _get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _post(url: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


# Through the Engine interface


async def test_start_reads_the_servers_figures(backend: tuple[SimServer, VLLMEngine]) -> None:
    server, client = backend
    info = client.info
    assert (info.kind, info.model, info.tp, info.max_running) == ("vllm", MODEL, 1, 64)
    assert info.kv_capacity_tokens == server.engine.info.kv_capacity_tokens
    assert (client.served_model, client.serving_path, client.weight_version) == (MODEL, MODEL, "default")


async def test_generate_returns_ids_phases_and_the_trajectory_cache(
    backend: tuple[SimServer, VLLMEngine],
) -> None:
    _, client = backend
    first = await client.generate(_req("t.0", n=300, key="t", input_len=1000))
    assert (first.output_len, first.finish_reason, first.cached_tokens) == (300, "length", 0)
    assert first.output_ids is not None and len(first.output_ids) == 300 and first.output_logprobs is None
    assert first.prefill_s > 0 and first.decode_s > 0 and first.weight_version == "default"
    # The next step repeats the previous context, generated tokens included, as on real text.
    second = await client.generate(_req("t.1", n=50, key="t", input_len=1500))
    assert second.cached_tokens == 1300


async def test_log_probs_and_alternatives_come_back_one_per_output_token(
    backend: tuple[SimServer, VLLMEngine],
) -> None:
    _, client = backend
    out = await client.generate(_req("lp.0", n=40, logprobs=True, top_logprobs=3))
    assert out.output_ids is not None and out.output_logprobs is not None
    assert out.output_top_logprobs is not None
    assert len(out.output_logprobs) == len(out.output_top_logprobs) == len(out.output_ids) == 40
    assert all(lp <= 0 for lp in out.output_logprobs) and len(set(out.output_logprobs)) > 1
    for t, lp, top in zip(out.output_ids, out.output_logprobs, out.output_top_logprobs, strict=True):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        # The k most likely tokens: the sampled one among them unless it is less likely than all of them.
        assert (t, lp) in top or lp < top[-1][1]
    alone = await client.generate(_req("lp.1", n=5, logprobs=True))
    assert alone.output_top_logprobs is None and alone.output_logprobs is not None


async def test_stop_token_ids_end_the_output_at_the_first_one(backend: tuple[SimServer, VLLMEngine]) -> None:
    _, client = backend
    ids = list(range(1, 65))
    full = await client.generate(_req("s.0", n=30, input_ids=ids))
    assert full.output_ids is not None
    stop = full.output_ids[9]
    # The same request again (the same draws), with a stop id.
    out = await client.generate(_req("s.0", n=30, input_ids=ids, stop_token_ids=[stop]))
    cut = full.output_ids.index(stop) + 1
    assert (out.output_ids, out.output_len, out.finish_reason) == (full.output_ids[:cut], cut, "stop")


async def test_priorities_reach_the_server_negated(backend: tuple[SimServer, VLLMEngine]) -> None:
    server, client = backend
    for i, p in enumerate((0.0, 12.4, 3000.0, -7.0)):
        await client.generate(_req(f"p{i}", n=2, priority=p))
    # vLLM serves lower values first, Loom larger ones.
    assert (await server.received())["priorities"] == [0, -12, -3000, 7]


# What Qwen3's generation_config.json sets, which vLLM applies to every field a request leaves out.
QWEN3_GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}


async def test_every_field_that_shapes_the_distribution_is_sent_over_the_model_s_defaults() -> None:
    async with (
        SimServer(options=Options(generation_defaults=QWEN3_GENERATION)) as server,
        started(VLLMEngine(server.url, model=MODEL, poll_s=0.05)) as client,
    ):
        await client.generate(_req("loom", n=2, temperature=1.0, top_p=1.0))
        # A request that leaves the fields out samples from the model's truncated distribution, as real vLLM does.
        raw = await _post(
            server.url + "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        )
        assert raw["choices"][0]["finish_reason"] in ("length", "stop")
        loom, bare = (await server.received())["sampling"]
    neutral = {
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert loom == {"temperature": 1.0, "top_p": 1.0, **neutral}
    assert bare == {**neutral, **QWEN3_GENERATION}


def test_the_model_s_generation_config_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    from loom.engine.fakes.vllm_server import generation_defaults

    config = {
        **QWEN3_GENERATION,
        "do_sample": True,
        "eos_token_id": [151645, 151643],
        "repetition_penalty": None,
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert generation_defaults(tmp_path) == QWEN3_GENERATION  # the fields vLLM reads, those set


async def test_priority_orders_the_queue_when_one_request_runs_at_a_time() -> None:
    async with _backend(max_running=1) as (server, client):
        head = asyncio.create_task(client.generate(_req("head", n=100_000, priority=1000)))
        await until(lambda: server.engine.load().running == 1, poll_s=0.01)
        done: list[str] = []
        # The low request is the longer one, so that its reply cannot overtake high's on a busy machine.
        low = asyncio.create_task(client.generate(_req("low", n=300, priority=1)))
        low.add_done_callback(lambda _: done.append("low"))
        await until(lambda: server.engine.load().waiting == 1, poll_s=0.01)
        high = asyncio.create_task(client.generate(_req("high", n=10, priority=50.4)))
        high.add_done_callback(lambda _: done.append("high"))
        await until(lambda: server.engine.load().waiting == 2, poll_s=0.01)
        # vLLM does not preempt the running request for a higher priority: both still wait.
        await asyncio.sleep(0.1)
        assert server.engine.load().waiting == 2
        await client.abort("head")
        await asyncio.gather(head, low, high)
        assert done == ["high", "low"]


async def test_abort_by_rid_and_by_cancelling_the_caller(backend: tuple[SimServer, VLLMEngine]) -> None:
    server, client = backend
    calls = [asyncio.create_task(client.generate(_req(rid, n=100_000))) for rid in ("x.1", "x.10")]
    await until(lambda: server.engine.load().running == 2, poll_s=0.01)
    assert await client.abort("x.1")
    out = await asyncio.wait_for(calls[0], 5)
    assert out.finish_reason == "abort" and 0 < out.output_len < 100_000
    assert not await client.abort("x.1")
    # vLLM aborts by exact id: "x.1" took nothing else with it.
    assert not calls[1].done() and server.engine.load().running == 1
    assert await client.abort("x.10")
    assert (await asyncio.wait_for(calls[1], 5)).finish_reason == "abort"

    call = asyncio.create_task(client.generate(_req("y.0", n=100_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: server.engine.load().running == 0, within_s=0.5)  # /abort_requests, not a disconnect
    assert (await server.received())["aborted"] == [engine_rid(r) for r in ("x.1", "x.10", "y.0")]


async def test_pause_holds_requests_and_resume_finishes_them(backend: tuple[SimServer, VLLMEngine]) -> None:
    server, client = backend
    call = asyncio.create_task(client.generate(_req("p.0", n=100_000)))  # about 0.6 s at this speed
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    await asyncio.sleep(0.1)
    await client.pause()
    assert (await _get(server.url + "/is_paused")) == {"is_paused": True}
    held = server.engine.load().generated_tokens
    await asyncio.sleep(0.5)
    assert 0 < server.engine.load().generated_tokens == held < 100_000 and not call.done()
    await client.resume()
    out = await asyncio.wait_for(call, 10)
    assert (out.output_len, out.finish_reason) == (100_000, "length")
    received = await server.received()
    assert (received["pauses"], received["resumes"]) == (["keep"], 1)


async def test_a_two_phase_update_reloads_labels_and_resets_the_cache(
    backend: tuple[SimServer, VLLMEngine], tmp_path: Path
) -> None:
    server, client = backend
    with pytest.raises(ValueError, match="checkpoint path"):
        await client.prepare_weights("step-7", Incoming.disk(None))
    await client.generate(_req("w.0", n=100, key="w"))
    await client.prepare_weights("step-7", Incoming.disk(str(tmp_path)))  # vLLM reloads in place: nothing yet
    assert (await client.generate(_req("w.1", n=5, key="w", input_len=1100))).weight_version == "default"
    await client.commit_weights("step-7")
    assert (client.weight_version, client.serving_path, client.previous_path) == (
        "step-7",
        str(tmp_path),
        MODEL,
    )
    # The prefix cache held KV of the old weights: the trajectory prefills its context again.
    out = await client.generate(_req("w.2", n=5, key="w", input_len=1200))
    assert (out.weight_version, out.cached_tokens) == ("step-7", 0)
    assert (await _get(server.url + "/weight_info")) == {"weight_version": "step-7"}
    assert (await _get(server.url + "/v1/models"))["data"][0]["root"] == str(tmp_path)
    received = await server.received()
    assert (received["reloads"], received["versions"], received["cache_resets"]) == (
        [str(tmp_path)],
        ["step-7"],
        [True],
    )
    await client.prepare_weights("step-8", Incoming.disk("org/ckpt-step-8"))
    await client.discard_weights("step-8")
    with pytest.raises(RuntimeError, match="not prepared"):
        await client.commit_weights("step-8")


async def test_a_request_in_flight_finishes_under_the_new_weights(
    backend: tuple[SimServer, VLLMEngine], tmp_path: Path
) -> None:
    server, client = backend
    call = asyncio.create_task(client.generate(_req("f.1", n=100_000, key="f")))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    await client.pause()
    await client.prepare_weights("step-9", Incoming.disk(str(tmp_path)))
    await client.commit_weights("step-9")
    # Preempted by the cache reset, it waits to recompute its context, then goes on under the new weights.
    assert server.engine.load().waiting == 1
    await client.resume()
    out = await asyncio.wait_for(call, 20)
    assert (out.output_len, out.finish_reason, out.weight_version) == (100_000, "length", "step-9")


async def test_a_failed_reload_raises_and_loads_the_served_checkpoint_back(
    backend: tuple[SimServer, VLLMEngine], tmp_path: Path
) -> None:
    server, client = backend
    missing = str(tmp_path / "no-such-checkpoint")
    await client.prepare_weights("step-7", Incoming.disk(missing))
    with pytest.raises(WeightUpdateError, match=rf"{re.escape(missing)}.*reloaded '{MODEL}'"):
        await client.commit_weights("step-7")
    assert (client.weight_version, client.serving_path) == ("default", MODEL)
    assert (await client.generate(_req("w.0", n=5))).weight_version == "default"
    assert (await server.received())["reloads"] == [MODEL]


async def test_load_figures_come_from_the_metrics(backend: tuple[SimServer, VLLMEngine]) -> None:
    _, client = backend
    assert client.load().running == client.load().generated_tokens == 0
    calls = [asyncio.create_task(client.generate(_req(f"l{i}.0", n=100_000))) for i in range(4)]
    await until(lambda: client.load().running == 4, poll_s=0.01)
    load = client.load()
    assert load.kv_used_tokens >= 4 * 1000 and load.kv_capacity_tokens == client.info.kv_capacity_tokens
    assert 0 < load.extra["token_usage"] < 1
    for i in range(4):
        await client.abort(f"l{i}.0")
    generated = sum(out.output_len for out in await asyncio.gather(*calls))
    await until(
        lambda: client.load().running == 0 and client.load().generated_tokens == generated > 0, poll_s=0.01
    )


async def test_warm_prefix_caches_the_context_for_the_next_request(
    backend: tuple[SimServer, VLLMEngine],
) -> None:
    _, client = backend
    await client.warm_prefix("migrated", 3000)
    out = await client.generate(_req("m.5", n=20, key="migrated", input_len=3400))
    # With the one token vLLM samples after a prefill (the context it left cached, as the client repeats it).
    assert out.cached_tokens == 3001
    cold = await client.generate(_req("n.5", n=20, key="never-warmed", input_len=3400))
    assert cold.cached_tokens == 0


async def test_forced_ids_are_scored_as_the_model_sampled_them(backend: tuple[SimServer, VLLMEngine]) -> None:
    server, client = backend
    ids = list(range(100, 400))
    sampled = await client.generate(_req("g.0", n=25, input_ids=ids, logprobs=True))
    assert sampled.output_ids is not None and sampled.output_logprobs is not None
    # The same reply, forced: vLLM's prompt log-probs of the context and the reply, read at the reply.
    forced = await client.generate(
        _req("g.1", n=100, input_ids=ids, logprobs=True, top_logprobs=2, forced_ids=sampled.output_ids)
    )
    assert (forced.output_ids, forced.output_len, forced.finish_reason) == (sampled.output_ids, 25, "length")
    assert forced.output_logprobs == pytest.approx(sampled.output_logprobs)
    assert forced.output_top_logprobs is not None and all(len(t) == 2 for t in forced.output_top_logprobs)
    assert forced.prefill_s > 0 and forced.decode_s == 0
    # max_new_tokens cuts a longer reply; the prompt log-probs read no cached prefix, as vLLM's do.
    cut = await client.generate(
        _req("g.2", n=10, input_ids=ids, logprobs=True, forced_ids=sampled.output_ids)
    )
    assert cut.output_ids == sampled.output_ids[:10] and cut.output_logprobs == forced.output_logprobs[:10]
    assert cut.cached_tokens == 0
    assert (await server.received())["scored"] == 2
    none = await client.generate(_req("g.3", n=10, input_ids=ids, logprobs=True, forced_ids=[]))
    assert (none.output_ids, none.output_logprobs, none.finish_reason) == ([], [], "length")


async def test_the_context_limit_is_read_and_enforced_as_vllm_does() -> None:
    async with (
        SimServer(options=Options(max_model_len=4096)) as server,
        started(VLLMEngine(server.url, model=MODEL, poll_s=0.05)) as client,
    ):
        assert client.info.max_context_tokens == 4096 and client.info.kv_capacity_tokens > 4096
        # Within the limit an output that cannot fit is cut to what does.
        out = await client.generate(_req("c.0", n=1000, input_len=3500))
        assert (out.output_len, out.finish_reason) == (596, "length")
        with pytest.raises(ValueError, match="your prompt contains 4097 input tokens"):
            await client.generate(_req("c.1", n=10, input_len=4097))
        with pytest.raises(ValueError, match="max_tokens=5000 cannot be greater than max_model_len=4096"):
            await client.generate(_req("c.2", n=5000, input_len=10))


async def test_an_oversized_request_is_a_bad_request(backend: tuple[SimServer, VLLMEngine]) -> None:
    server, client = backend
    too_big = client.info.kv_capacity_tokens + 1
    with pytest.raises(
        ValueError, match=rf"{server.url}/v1/completions: HTTP 400: max_tokens={too_big} cannot"
    ):
        await client.generate(_req("huge.0", n=too_big))


async def test_an_unreachable_server_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(VLLMError, match=re.escape(f"{url}/v1/models")):
        await VLLMEngine(url).start()


async def test_a_server_without_dev_mode_is_a_clear_error() -> None:
    # What vLLM serves without VLLM_SERVER_DEV_MODE=1: none of its dev routes.
    dev = {"/server_info", "/pause", "/resume", "/is_paused", "/abort_requests", "/collective_rpc"}
    async with SimServer() as server:
        server.app.router.routes[:] = [
            r for r in server.app.router.routes if not (isinstance(r, APIRoute) and r.path in dev)
        ]
        with pytest.raises(VLLMError, match="VLLM_SERVER_DEV_MODE=1"):
            await VLLMEngine(server.url).start()


# A rollout worker over NATS, driving the server as it would drive vLLM


def test_the_vllm_engine_needs_a_url() -> None:
    with pytest.raises(ValueError, match="LOOM_ROLLOUT_VLLM_URL"):
        make_engine(Runtime("rollout", RolloutSettings()), RolloutSettings(engine="vllm"))
    engine = make_engine(
        Runtime("rollout", RolloutSettings()), RolloutSettings(engine="vllm", vllm_url="http://h:8000/")
    )
    assert isinstance(engine, VLLMEngine) and engine.url == "http://h:8000"


async def test_a_request_through_the_router_is_served_by_vllm(nc: NATS, services: Services) -> None:
    async with SimServer() as server:
        settings = RolloutSettings(worker_id="wvl", engine="vllm", vllm_url=server.url, speed=SPEED)
        await served_through_the_router(nc, services, server, settings)

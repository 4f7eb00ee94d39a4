"""The SGLang client against the SGLang-compatible server over the simulated engine, then a rollout worker
driving that server over NATS, as it would drive a real SGLang."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client as NATS

from loom.clock import Clock
from loom.engine.base import EngineRequest
from loom.engine.clients.sglang import SGLangEngine, SGLangError, WeightUpdateError
from loom.engine.fakes.sglang_server import Options, build_app
from loom.engine.sim.engine import SimEngine
from loom.runtime.service import Runtime
from loom.weights import Incoming
from loom_cli.simserver import register
from services.rollout.__main__ import make_engine
from services.rollout.settings import RolloutSettings
from tests import sim_servers
from tests.conftest import Services
from tests.integration.helpers import until
from tests.sim_servers import request as _req
from tests.sim_servers import served_through_the_router, sim_server_process, started

SPEED = 500.0
MODEL = "qwen3-0.6b"


class SimServer(sim_servers.SimServer):
    """The compat server on a free port, uvicorn in-process, over a sped-up simulated engine."""

    def __init__(self, max_running: int = 64) -> None:
        engine = SimEngine(model=MODEL, clock=Clock(SPEED), max_running=max_running)
        super().__init__(engine, build_app(engine))


@contextlib.asynccontextmanager
async def _backend(max_running: int = 64) -> AsyncIterator[tuple[SimServer, SGLangEngine]]:
    async with (
        SimServer(max_running) as server,
        started(SGLangEngine(server.url, model=MODEL, poll_s=0.05)) as c,
    ):
        yield server, c


@pytest.fixture
async def backend() -> AsyncIterator[tuple[SimServer, SGLangEngine]]:
    async with _backend() as pair:
        yield pair


async def _post(url: str, body: object) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.text()


# Through the Engine interface


async def test_generate_reports_exact_length_phases_and_the_trajectory_cache(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    _, client = backend
    assert (client.info.kind, client.info.max_running) == ("sglang", 64)
    first = await client.generate(_req("t.0", n=300, key="t", input_len=1000))
    assert (first.output_len, first.finish_reason, first.cached_tokens) == (300, "length", 0)
    assert first.output_ids is not None and len(first.output_ids) == 300
    assert first.prefill_s > 0 and first.decode_s > 0
    # The next step repeats the previous context, generated tokens included, as on real text.
    second = await client.generate(_req("t.1", n=50, key="t", input_len=1500))
    assert second.cached_tokens == 1300


async def test_concurrent_generates(backend: tuple[SimServer, SGLangEngine]) -> None:
    server, client = backend
    outs = await asyncio.gather(*(client.generate(_req(f"c{i}.0", n=100 + i)) for i in range(16)))
    assert [o.output_len for o in outs] == [100 + i for i in range(16)]
    assert server.engine.load().generated_tokens == sum(100 + i for i in range(16))


async def test_abort_by_rid_and_by_cancelling_the_caller(backend: tuple[SimServer, SGLangEngine]) -> None:
    server, client = backend
    # "x.1" is a prefix of "x.10": SGLang aborts by rid prefix, the client's rids must not collide.
    calls = [asyncio.create_task(client.generate(_req(rid, n=100_000))) for rid in ("x.1", "x.10")]
    await until(lambda: server.engine.load().running == 2, poll_s=0.01)
    assert await client.abort("x.1")
    out = await asyncio.wait_for(calls[0], 5)
    assert out.finish_reason == "abort" and out.output_len < 100_000
    assert not await client.abort("x.1")
    assert not calls[1].done() and server.engine.load().running == 1
    assert await client.abort("x.10")
    assert (await asyncio.wait_for(calls[1], 5)).finish_reason == "abort"

    call = asyncio.create_task(client.generate(_req("y.0", n=100_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: server.engine.load().running == 0, within_s=0.5)  # /abort_request, not a timeout


async def test_priority_orders_the_queue_when_one_request_runs_at_a_time() -> None:
    async with _backend(max_running=1) as (server, client):
        # The running request has the highest priority: SGLang would preempt a lower one.
        head = asyncio.create_task(client.generate(_req("head", n=100_000, priority=1000)))
        await until(lambda: server.engine.load().running == 1, poll_s=0.01)
        done: list[str] = []
        # The low request is the longer one, so that its reply cannot overtake high's on a busy machine
        # (seen once with both at 10 tokens); a wrong order would still run low first and finish it first.
        low = asyncio.create_task(client.generate(_req("low", n=300, priority=1)))
        low.add_done_callback(lambda _: done.append("low"))
        await until(lambda: server.engine.load().waiting == 1, poll_s=0.01)
        high = asyncio.create_task(client.generate(_req("high", n=10, priority=50.4)))
        high.add_done_callback(lambda _: done.append("high"))
        await until(lambda: server.engine.load().waiting == 2, poll_s=0.01)
        await client.abort("head")
        await asyncio.gather(head, low, high)
        assert done == ["high", "low"]


async def test_warm_prefix_caches_the_context_for_the_next_request(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    _, client = backend
    await client.warm_prefix("migrated", 3000)
    out = await client.generate(_req("m.5", n=20, key="migrated", input_len=3400))
    assert out.cached_tokens == 3000
    cold = await client.generate(_req("n.5", n=20, key="never-warmed", input_len=3400))
    assert cold.cached_tokens == 0


async def test_pause_holds_requests_and_continue_finishes_them(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    server, client = backend
    call = asyncio.create_task(client.generate(_req("p.0", n=100_000)))  # about 0.6 s at this speed
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    await asyncio.sleep(0.1)
    await client.pause()
    held = server.engine.load().generated_tokens
    await asyncio.sleep(0.5)
    assert 0 < server.engine.load().generated_tokens == held < 100_000 and not call.done()
    await client.resume()
    out = await asyncio.wait_for(call, 10)
    assert (out.output_len, out.finish_reason) == (100_000, "length")
    # SGLang's default pause mode aborts what is in flight; the client asks for "in_place" for that reason.
    call = asyncio.create_task(client.generate(_req("p.1", n=100_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    assert (await _post(server.url + "/pause_generation", {}))[0] == 200
    assert (await asyncio.wait_for(call, 5)).finish_reason == "abort"
    await client.resume()


async def test_log_probs_come_back_one_per_output_token(backend: tuple[SimServer, SGLangEngine]) -> None:
    server, client = backend
    out = await client.generate(_req("lp.0", n=40, logprobs=True))
    assert out.output_ids is not None and out.output_logprobs is not None
    assert len(out.output_logprobs) == len(out.output_ids) == 40
    assert all(lp <= 0 for lp in out.output_logprobs) and len(set(out.output_logprobs)) > 1
    assert (await client.generate(_req("lp.1", n=40))).output_logprobs is None
    # SGLang's shape: [logprob, token_id, text] per output token; the prompt's from its last position.
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9},
        "return_logprob": True,
    }
    status, text = await _post(server.url + "/generate", body)
    meta = json.loads(text)["meta_info"]
    assert status == 200 and [t[1:] for t in meta["output_token_logprobs"]] == [
        [i, None] for i in json.loads(text)["output_ids"]
    ]
    assert meta["input_token_logprobs"] == [[None, 8, None]]  # the first entry's logprob is always null
    status, text = await _post(server.url + "/generate", {**body, "logprob_start_len": 0})
    prompt = json.loads(text)["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in prompt] == [5, 6, 7, 8] and prompt[0][0] is None and prompt[1][0] <= 0
    status, _ = await _post(server.url + "/generate", {**body, "sampling_params": {"top_p": 0}})
    assert status == 400
    # SGLang disables top-k with -1 alone (what Loom sends); 0, vLLM's way, is refused.
    for bad in ({"top_k": 0}, {"min_p": 1.5}, {"repetition_penalty": 2.5}, {"presence_penalty": -3}):
        status, text = await _post(server.url + "/generate", {**body, "sampling_params": bad})
        assert status == 400, (bad, text)


async def test_a_forced_reply_is_scored_by_a_prefill_only_request(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    """Teacher forcing on SGLang: the context and the reply go as one prefill (max_new_tokens 0) whose input
    log-probs from the context's last position are the reply's; nothing is decoded."""
    server, client = backend
    ctx, reply = [5, 6, 7, 8], [40, 41, 42]
    forced = EngineRequest(
        rid="forced.0",
        input_len=4,
        max_new_tokens=8,
        input_ids=ctx,
        return_logprob=True,
        top_logprobs=2,
        forced_ids=reply,
    )
    generated = server.engine.load().generated_tokens
    out = await client.generate(forced)
    assert out.output_ids == reply and out.output_len == 3 and out.finish_reason == "length"
    assert out.output_logprobs is not None and len(out.output_logprobs) == 3
    assert all(lp <= 0 for lp in out.output_logprobs)
    assert out.output_top_logprobs is not None
    assert all(
        len(row) == 2 and row[0][1] >= row[1][1] and ((t, lp) in row or lp < row[-1][1])
        for t, lp, row in zip(reply, out.output_logprobs, out.output_top_logprobs, strict=True)
    )
    assert server.engine.load().generated_tokens == generated  # a prefill: no token decoded
    # The same as scoring the whole sequence by hand.
    body = {
        "input_ids": ctx + reply,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 3,
    }
    _, text = await _post(server.url + "/generate", body)
    triples = json.loads(text)["meta_info"]["input_token_logprobs"]
    assert [t[0] for t in triples[1:]] == out.output_logprobs


async def test_a_two_phase_update_changes_the_reported_version(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    server, client = backend
    assert (client.weight_version, client.serving_path) == ("default", MODEL)
    with pytest.raises(ValueError, match="checkpoint path"):
        await client.prepare_weights("step-7", Incoming.disk(None))
    await client.prepare_weights(
        "step-7", Incoming.disk("org/ckpt-step-7")
    )  # SGLang loads in place: nothing yet
    assert (await client.generate(_req("w.0", n=5))).weight_version == "default"
    await client.commit_weights("step-7")
    assert (await client.generate(_req("w.1", n=5))).weight_version == "step-7"
    assert (client.weight_version, client.serving_path, client.previous_path) == (
        "step-7",
        "org/ckpt-step-7",
        MODEL,
    )
    async with aiohttp.ClientSession() as s, s.get(server.url + "/get_model_info") as r:
        info = await r.json()
    assert (info["weight_version"], info["model_path"]) == ("step-7", "org/ckpt-step-7")
    await client.prepare_weights("step-8", Incoming.disk("org/ckpt-step-8"))
    await client.discard_weights("step-8")
    with pytest.raises(RuntimeError, match="not prepared"):
        await client.commit_weights("step-8")


async def test_a_request_in_flight_finishes_under_the_new_weights(
    backend: tuple[SimServer, SGLangEngine], tmp_path: Path
) -> None:
    server, client = backend
    await client.generate(_req("f.0", n=100, key="f"))
    call = asyncio.create_task(client.generate(_req("f.1", n=100_000, key="f", input_len=1200)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    await client.pause()
    await client.prepare_weights("step-9", Incoming.disk(str(tmp_path)))
    # Paused in place with a request running: SGLang's cache flush would fail (see the next test), so the
    # client does not ask for it; the request goes on with its KV.
    await client.commit_weights("step-9")
    await client.resume()
    out = await asyncio.wait_for(call, 20)
    assert (out.output_len, out.finish_reason, out.weight_version) == (100_000, "length", "step-9")
    # Once idle, the client flushed the cache the old weights computed: the trajectory prefills it all again.
    nxt = await client.generate(_req("f.2", n=5, key="f", input_len=101_300))
    assert (nxt.cached_tokens, nxt.weight_version) == (0, "step-9")


async def test_a_failed_update_raises_the_servers_message_and_keeps_the_weights(
    backend: tuple[SimServer, SGLangEngine], tmp_path: Path
) -> None:
    server, client = backend
    missing = str(tmp_path / "no-such-checkpoint")
    await client.prepare_weights("step-7", Incoming.disk(missing))
    with pytest.raises(WeightUpdateError, match=f"no model directory at {re.escape(missing)}"):
        await client.commit_weights("step-7")
    assert (client.weight_version, client.serving_path) == ("default", MODEL)
    assert (await client.generate(_req("w.0", n=5))).weight_version == "default"
    status, text = await _post(server.url + "/update_weights_from_disk", {"model_path": missing})
    assert status == 400 and json.loads(text) == {
        "success": False,
        "message": f"Failed to get weights iterator: no model directory at {missing}.",
        "num_paused_requests": 0,
    }
    # SGLang's flush after a load needs an idle scheduler: paused in place with a request running, its
    # scheduler dies on an assertion; the simulator answers 500.
    call = asyncio.create_task(client.generate(_req("w.1", n=100_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    await client.pause()
    body = {"model_path": str(tmp_path), "weight_version": "step-8"}
    status, text = await _post(server.url + "/update_weights_from_disk", body)
    assert status == 500 and "Cache flush failed" in json.loads(text)["message"]
    await client.resume()
    await client.abort("w.1")
    assert (await call).weight_version == "default"


async def test_an_update_not_paused_waits_for_the_requests_in_flight(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    server, client = backend
    call = asyncio.create_task(client.generate(_req("u.0", n=20_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    update = asyncio.create_task(
        _post(server.url + "/update_weights_from_disk", {"model_path": "org/next", "weight_version": "v2"})
    )
    out = await asyncio.wait_for(call, 20)
    assert out.weight_version == "default"  # SGLang's model-update lock: the load waited for it
    assert (await asyncio.wait_for(update, 5))[0] == 200
    assert (await client.generate(_req("u.1", n=5))).weight_version == "v2"


async def test_load_figures_move(backend: tuple[SimServer, SGLangEngine]) -> None:
    _, client = backend
    assert client.load().running == client.load().generated_tokens == 0
    calls = [asyncio.create_task(client.generate(_req(f"l{i}.0", n=100_000))) for i in range(4)]
    await until(lambda: client.load().running == 4, poll_s=0.01)
    assert client.load().kv_used_tokens >= 4 * 1000
    for i in range(4):
        await client.abort(f"l{i}.0")
    generated = sum(out.output_len for out in await asyncio.gather(*calls))
    await until(
        lambda: client.load().running == 0 and client.load().generated_tokens == generated > 0, poll_s=0.01
    )


async def test_the_context_length_is_read_and_enforced_as_sglang_does() -> None:
    engine = SimEngine(model=MODEL, clock=Clock(SPEED))
    app = build_app(engine, Options(context_length=4096))
    async with (
        sim_servers.SimServer(engine, app) as server,
        started(SGLangEngine(server.url, model=MODEL)) as client,
    ):
        assert client.info.max_context_tokens == 4096
        # SGLang refuses an explicit output that cannot fit, where vLLM cuts it: Loom never asks for one.
        with pytest.raises(
            ValueError, match="Requested token count exceeds the model's maximum context length"
        ):
            await client.generate(_req("c.0", n=1000, input_len=3500))
        with pytest.raises(ValueError, match=r"The input \(4096 tokens\) is longer than the model's context"):
            await client.generate(_req("c.1", n=10, input_len=4096))
        out = await client.generate(_req("c.2", n=596, input_len=3500))
        assert (out.output_len, out.finish_reason) == (596, "length")


# The HTTP API itself


async def test_metrics_and_info_use_sglang_names(backend: tuple[SimServer, SGLangEngine]) -> None:
    server, client = backend
    await client.generate(_req("m.0", n=10))
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            text = await r.text()
        for name in (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "sglang:gen_throughput",
            "sglang:cache_hit_rate",
            "sglang:prompt_tokens_total",
            "sglang:generation_tokens_total",
            "sglang:time_to_first_token_seconds_bucket",
            "sglang:e2e_request_latency_seconds_count",
        ):
            assert f"\n{name}{{" in text, name
        async with s.get(server.url + "/get_load") as r:
            assert (await r.json())[0].keys() == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
        for path in ("/health", "/health_generate", "/flush_cache"):
            async with s.get(server.url + path) as r:
                assert r.status == 200, path


async def test_streaming_ends_with_done(backend: tuple[SimServer, SGLangEngine]) -> None:
    server, _ = backend
    body = {"input_ids": list(range(1, 65)), "sampling_params": {"max_new_tokens": 7}, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/generate", json=body) as r:
        assert r.content_type == "text/event-stream"
        events = [line for line in (await r.text()).split("\n") if line]
    assert events[-1] == "data: [DONE]"
    chunk = json.loads(events[-2].removeprefix("data: "))
    assert len(chunk["output_ids"]) == chunk["meta_info"]["completion_tokens"] == 7
    assert chunk["meta_info"]["finish_reason"] == {"type": "length", "length": 7}


async def test_malformed_and_oversized_requests_are_bad_requests(
    backend: tuple[SimServer, SGLangEngine],
) -> None:
    server, client = backend
    status, text = await _post(server.url + "/generate", {"input_ids": "not ids"})
    assert status == 400 and json.loads(text)["code"] == 400
    status, text = await _post(server.url + "/generate", {"text": "hello"})
    assert status == 400 and "input_ids" in json.loads(text)["error"]["message"]
    too_big = client.info.kv_capacity_tokens + 1
    with pytest.raises(ValueError, match=rf"{server.url}/generate: HTTP 400"):
        await client.generate(_req("huge.0", n=too_big))


async def test_an_unreachable_server_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(SGLangError, match=re.escape(f"{url}/get_model_info")):
        await SGLangEngine(url).start()


async def test_sim_server_command_serves_until_sigterm() -> None:
    parser = argparse.ArgumentParser(prog="loom")
    register(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["sim-server", "--port", "0", "--speed", "50"])
    assert (args.host, args.model, args.gpu, args.tp, args.speed) == (
        "127.0.0.1",
        "qwen3-8b",
        "h100",
        1,
        50.0,
    )

    async with (
        sim_server_process("--model", MODEL) as (url, _),
        aiohttp.ClientSession() as http,
        http.get(url + "/get_model_info") as r,
    ):
        assert (await r.json())["model_path"] == MODEL


# A rollout worker over NATS, driving the server as it would drive SGLang


def test_the_sglang_engine_needs_a_url() -> None:
    with pytest.raises(ValueError, match="LOOM_ROLLOUT_SGLANG_URL"):
        make_engine(Runtime("rollout", RolloutSettings()), RolloutSettings(engine="sglang"))


async def test_a_request_through_the_router_is_served_by_sglang(nc: NATS, services: Services) -> None:
    async with SimServer() as server:
        settings = RolloutSettings(worker_id="wsg", engine="sglang", sglang_url=server.url, speed=SPEED)
        await served_through_the_router(nc, services, server, settings)

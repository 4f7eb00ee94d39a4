"""The vLLM-compatible server's HTTP API itself, over real HTTP: vLLM's shapes, names and error answers, and
`loom sim-server --api vllm` as a command."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loom.engine.clients.vllm import engine_rid
from loom.engine.fakes.next_token import raw_logprob
from loom_cli.simserver import register
from tests.integration.helpers import until
from tests.sim_servers import sim_server_process
from tests.unit.test_vllm_client import MODEL, SimServer


@pytest.fixture
async def server() -> AsyncIterator[SimServer]:
    async with SimServer() as s:
        yield s


async def _call(url: str, method: str = "GET", body: object = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(method, url, json=body) as r:
        text = await r.text()
        return r.status, json.loads(text) if text else None


def _completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3, "return_token_ids": True, **kw}


async def test_a_completion_in_vllms_shape(server: SimServer) -> None:
    body = _completion(logprobs=2, prompt_logprobs=1, return_weight_versions=True, request_id="r1")
    status, out = await _call(server.url + "/v1/completions", "POST", body)
    assert status == 200 and (out["id"], out["object"], out["model"]) == ("cmpl-r1", "text_completion", MODEL)
    (choice,) = out["choices"]
    ids = choice["token_ids"]
    assert len(ids) == 3 and choice["prompt_token_ids"] == [5, 6, 7, 8]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("length", None, "")
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 3}]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    # At temperature 1, untruncated, the distribution sampled from is the model's own.
    assert lp["token_logprobs"] == pytest.approx(
        [raw_logprob(p, t) for p, t in itertools.pairwise([8, *ids])]
    )
    # The sampled token and the top 2, keyed as return_tokens_as_token_ids names them.
    assert all(
        f"token_id:{t}" in top and 2 <= len(top) <= 3 for t, top in zip(ids, lp["top_logprobs"], strict=True)
    )
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == 4
    for t, row in zip([6, 7, 8], prompt[1:], strict=True):
        assert str(t) in row and set(row[str(t)]) == {"logprob", "rank", "decoded_token"}
    assert [row[str(t)]["logprob"] for t, row in zip([6, 7, 8], prompt[1:], strict=True)] == pytest.approx(
        [raw_logprob(p, t) for p, t in itertools.pairwise([5, 6, 7, 8])]
    )
    assert out["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert set(out["metrics"]) >= {"queue_time_ms", "time_to_first_token_ms", "generation_time_ms"}
    # Without return_token_ids vLLM leaves the ids out.
    status, out = await _call(server.url + "/v1/completions", "POST", {"prompt": [5, 6], "max_tokens": 2})
    assert status == 200 and out["choices"][0]["token_ids"] is None and out["choices"][0]["logprobs"] is None


async def test_bad_requests_are_answered_as_vllm_does(server: SimServer) -> None:
    url = server.url + "/v1/completions"
    cases: list[tuple[dict[str, Any], int, str]] = [
        (_completion(prompt="hello"), 400, "no tokenizer"),
        (_completion(prompt=[]), 400, "must be provided"),
        (_completion(prompt=[[1, 2], [3]]), 400, "batch"),
        (_completion(max_tokens=0), 400, "max_tokens must be at least 1"),
        (_completion(top_p=0), 400, "top_p"),
        (_completion(logprobs=21), 400, "max allowed: 20"),
        (_completion(stream=True), 400, "streams"),
        (_completion(model="other"), 404, "does not exist"),
        (_completion(max_tokens=10**9), 400, "cannot be greater than max_model_len=654328"),
        (_completion(priority="high"), 400, "priority"),
    ]
    for body, code, message in cases:
        status, out = await _call(url, "POST", body)
        assert (status, out["error"]["code"]) == (code, code), body
        assert message in out["error"]["message"], out


async def test_metrics_use_vllm_names_and_labels(server: SimServer) -> None:
    await _call(server.url + "/v1/completions", "POST", _completion())
    async with aiohttp.ClientSession() as s, s.get(server.url + "/metrics") as r:
        text = await r.text()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_sum",
    ):
        assert re.search(rf'\n{name}{{engine="0",.*model_name="{MODEL}"', text), name
    assert re.search(r'vllm:request_success_total\{.*finished_reason="length".*\} 1\.0', text)
    assert re.search(r"vllm:generation_tokens_total\{.*\} 3\.0", text)


async def test_info_routes(server: SimServer) -> None:
    status, info = await _call(server.url + "/server_info?config_format=json")
    config = info["vllm_config"]
    assert status == 200 and config["scheduler_config"] == {"policy": "priority", "max_num_seqs": 64}
    assert config["cache_config"]["kv_cache_size_tokens"] == server.engine.info.kv_capacity_tokens
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert isinstance((await _call(server.url + "/server_info"))[1]["vllm_config"], str)
    assert (await _call(server.url + "/version"))[1] == {"version": "0.33.0"}
    async with aiohttp.ClientSession() as s, s.get(server.url + "/health") as r:
        assert r.status == 200
    status, models = await _call(server.url + "/v1/models")
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] > 0


async def test_pause_abort_and_wait_refuse_new_requests_until_resume(server: SimServer) -> None:
    url = server.url
    long = asyncio.create_task(_call(url + "/v1/completions", "POST", _completion(max_tokens=100_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    assert (await _call(url + "/pause?mode=abort", "POST"))[1] == {"status": "paused"}
    assert (await long)[1]["choices"][0]["finish_reason"] == "abort"
    status, out = await _call(url + "/v1/completions", "POST", _completion())
    assert (status, out["error"]["type"]) == (503, "ServiceUnavailableError")
    assert (await _call(url + "/resume", "POST"))[1] == {"status": "resumed"}
    # "wait" lets the running request finish before it answers.
    long = asyncio.create_task(_call(url + "/v1/completions", "POST", _completion(max_tokens=30_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    assert (await _call(url + "/pause?mode=wait", "POST"))[0] == 200
    assert server.engine.load().running == 0 and not server.engine.core.preemptions
    assert (await asyncio.wait_for(long, 5))[1]["choices"][0]["finish_reason"] == "length"
    assert (await _call(url + "/is_paused"))[1] == {"is_paused": True}
    await _call(url + "/resume", "POST")
    assert (await _call(url + "/pause?mode=later", "POST"))[0] == 400
    assert (await server.received())["pauses"] == ["abort", "wait"]


async def test_abort_requests_by_id_or_all(server: SimServer) -> None:
    url = server.url
    calls = [
        asyncio.create_task(
            _call(url + "/v1/completions", "POST", _completion(max_tokens=100_000, request_id=f"a{i}"))
        )
        for i in range(3)
    ]
    await until(lambda: server.engine.load().running == 3, poll_s=0.01)
    out = await _call(url + "/abort_requests", "POST", {"request_ids": [engine_rid("a0")]})
    assert out[1] == {"status": "aborted", "aborted": 1}
    assert (await calls[0])[1]["choices"][0]["finish_reason"] == "abort"
    assert server.engine.load().running == 2
    assert (await _call(url + "/abort_requests", "POST", {}))[1] == {"status": "aborted", "aborted": 2}
    assert {(await c)[1]["choices"][0]["finish_reason"] for c in calls[1:]} == {"abort"}
    assert (await server.received())["aborted"] == [engine_rid("a0"), "*"]


async def test_reload_and_cache_reset(server: SimServer, tmp_path: Path) -> None:
    url = server.url
    rpc = url + "/collective_rpc"
    # update_config points the next reload at a checkpoint, as vLLM's workers take it.
    body = {"method": "update_config", "kwargs": {"overrides": {"model_config": {"model": str(tmp_path)}}}}
    assert await _call(rpc, "POST", body) == (200, {"results": [None]})
    assert await _call(rpc, "POST", {"method": "reload_weights"}) == (200, {"results": [None]})
    assert (await _call(url + "/v1/models"))[1]["data"][0]["root"] == str(tmp_path)
    status, out = await _call(
        rpc, "POST", {"method": "reload_weights", "kwargs": {"weights_path": "/no/such"}}
    )
    assert status == 500 and "/no/such" in out["error"]["message"]
    status, out = await _call(rpc, "POST", {"method": "update_config", "kwargs": {"overrides": {"x": {}}}})
    assert status == 500 and "'x' is not supported" in out["error"]["message"]
    assert (await _call(rpc, "POST", {"method": "sleep"}))[0] == 500
    assert (await _call(rpc, "POST", {"args": []}))[0] == 400
    update = await _call(url + "/update_weight_version", "POST", {"new_version": "v2"})
    assert update == (200, {"success": True, "new_version": "v2"})
    assert (await _call(url + "/weight_info"))[1] == {"weight_version": "v2"}
    # A reset without reset_running_requests fails while a request holds KV.
    long = asyncio.create_task(_call(url + "/v1/completions", "POST", _completion(max_tokens=100_000)))
    await until(lambda: server.engine.load().running == 1, poll_s=0.01)
    assert (await _call(url + "/reset_prefix_cache", "POST"))[1] == {"success": False}
    reset = await _call(url + "/reset_prefix_cache?reset_running_requests=true", "POST")
    assert reset[1] == {"success": True}
    await _call(url + "/abort_requests", "POST", {})
    assert (await long)[1]["choices"][0]["weight_versions"] is None
    received = await server.received()
    assert (received["reloads"], received["versions"], received["cache_resets"]) == (
        [str(tmp_path)],
        ["v2"],
        [True],
    )


async def test_sim_server_command_serves_vllms_api_until_sigterm() -> None:
    parser = argparse.ArgumentParser(prog="loom")
    register(parser.add_subparsers(dest="cmd", required=True))
    assert (parser.parse_args(["sim-server"]).api, parser.parse_args(["sim-server"]).port) == ("sglang", None)
    assert parser.parse_args(["sim-server", "--api", "vllm"]).api == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["sim-server", "--api", "trtllm"])

    async with sim_server_process("--api", "vllm", "--model", MODEL) as (url, line):
        assert "vLLM API" in line, line
        assert (await _call(url + "/v1/models"))[1]["data"][0]["id"] == MODEL

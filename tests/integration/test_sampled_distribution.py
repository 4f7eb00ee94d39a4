"""Loom records the log-probs of the distribution a trainer computes: the model's, at the job's temperature, with
nothing truncated, whatever defaults the server fills in. Each server here is set up as a real one serving
Qwen3 would be: vLLM reads the checkpoint's generation_config.json (top-k 20, top-p 0.95, temperature 0.6) for
every field a request leaves out; SGLang's /generate reads no generation config, and the server default it does
merge, --preferred-sampling-params, carries the same values. Each reported log-prob is checked against the full
distribution computed by brute force over the whole vocabulary, and the sampled tokens against what top-k 20
would have allowed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loom.clock import Clock
from loom.engine.base import Engine, EngineOutput
from loom.engine.clients.sglang import SGLangEngine
from loom.engine.clients.vllm import VLLMEngine
from loom.engine.fakes import sglang_server, vllm_server
from loom.engine.fakes.next_token import BACKGROUND, candidates
from loom.engine.sim.engine import SimEngine
from loom.engine.token_ids import QWEN3_ORDINARY
from tests.sim_servers import SimServer, request, started

MODEL = "qwen3-0.6b"
QWEN3_GENERATION = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
TEMPERATURE = 0.8  # the job's, not the checkpoint's
PROMPT = list(range(100, 164))
TOKENS = 300


def full_logprob(prev: int, token: int, temperature: float) -> tuple[float, int]:
    """log p(token | prev) of the model at ``temperature`` over every token of the vocabulary, and its rank."""
    logits = np.full(QWEN3_ORDINARY, BACKGROUND)
    ids, values, _ = candidates(prev)
    logits[list(ids)] = values
    scaled = logits / temperature
    logprobs = scaled - np.logaddexp.reduce(scaled)
    return float(logprobs[token]), int((logprobs > logprobs[token]).sum())


def check(out: EngineOutput) -> None:
    assert out.output_ids is not None and out.output_logprobs is not None and len(out.output_ids) == TOKENS
    ranks = []
    for prev, token, lp in zip(
        [PROMPT[-1], *out.output_ids], out.output_ids, out.output_logprobs, strict=False
    ):
        expected, rank = full_logprob(prev, token, TEMPERATURE)
        assert lp == pytest.approx(expected, abs=1e-6)
        ranks.append(rank)
    # Nothing truncated the draw: a good share of tokens rank beyond the 20 that top-k 20 keeps.
    assert sum(r >= 20 for r in ranks) > TOKENS // 10


async def _sample(engine: Engine) -> EngineOutput:
    req = request("d.0", n=TOKENS, input_ids=PROMPT, logprobs=True, temperature=TEMPERATURE, top_p=1.0)
    return await engine.generate(req)


async def test_vllm_with_qwen3_s_generation_config() -> None:
    engine = vllm_server.sim_engine(MODEL, "h100", 1, Clock(500.0))
    app = vllm_server.build_app(engine, vllm_server.Options(generation_defaults=QWEN3_GENERATION))
    async with SimServer(engine, app) as server, started(VLLMEngine(server.url, model=MODEL)) as client:
        check(await _sample(client))


async def test_sglang_with_the_same_server_defaults() -> None:
    engine = SimEngine(model=MODEL, clock=Clock(500.0))
    app = sglang_server.build_app(engine, sglang_server.Options(preferred_sampling_params=QWEN3_GENERATION))
    async with SimServer(engine, app) as server, started(SGLangEngine(server.url, model=MODEL)) as client:
        check(await _sample(client))


async def _seeded_draws(client: Engine) -> list[list[int] | None]:
    async def draw(rid: str, seed: int | None) -> list[int] | None:
        r = request(rid, n=40, input_ids=PROMPT, temperature=TEMPERATURE, top_p=1.0, seed=seed)
        return (await client.generate(r)).output_ids

    return [
        await draw("job-a.t0.0", 2**62 + 5),
        await draw("job-b.t0.0", 2**62 + 5),
        await draw("job-a.t0.0", 6),
        await draw("job-c.t0.0", None),
    ]


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_a_request_s_seed_reaches_the_server_and_repeats_its_draw(kind: str) -> None:
    """vLLM's ``seed`` and SGLang's ``sampling_seed``: two requests of one seed and prompt, under other ids, draw
    the same tokens; another seed, or none, draws apart."""
    engine = (
        vllm_server.sim_engine(MODEL, "h100", 1, Clock(500.0))
        if kind == "vllm"
        else SimEngine(model=MODEL, clock=Clock(500.0))
    )
    if kind == "vllm":
        app, client = vllm_server.build_app(engine, vllm_server.Options()), VLLMEngine
    else:
        app, client = sglang_server.build_app(engine, sglang_server.Options()), SGLangEngine
    async with SimServer(engine, app) as server, started(client(server.url, model=MODEL)) as c:
        a, b, other, unseeded = await _seeded_draws(c)
    assert a == b and a is not None and len(a) == 40
    assert other != a and unseeded != a


def test_the_brute_force_agrees_with_itself() -> None:
    """The reference is a distribution: its probabilities sum to 1 after any token."""
    for prev in itertools.islice(range(0, 200_000, 9973), 5):
        ids, _, _ = candidates(prev)
        total = sum(np.exp(full_logprob(prev, t, 0.7)[0]) for t in ids)
        others = (QWEN3_ORDINARY - len(ids)) * np.exp(full_logprob(prev, QWEN3_ORDINARY - 1, 0.7)[0])
        assert total + others == pytest.approx(1.0)

"""What the gateway honours of an agent's sampling: the cut at the first stop (token-exact: ids are never
re-tokenised), OpenAI's top_logprobs shapes, n choices in one response, and the engines' top alternatives and
stop ids."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.clients.hf import HFEngine
from loom.engine.sim.engine import _with_ids
from loom.engine.token_ids import QWEN3_VOCAB, synth_top_logprobs
from loom.protocol import from_json
from loom.protocol.sessions import ChatRequest, CompletionRequest
from loom.text import chat, openai_api
from loom.text.tokenizer import ENDOFTEXT, IM_END, chat_tokenizer
from tests.integration.test_sglang_backend import _backend
from tests.unit.test_hf_engine import PROMPTS, engine_at, full_logits, models, req  # noqa: F401

# Pieces that make stop strings likely to appear, whole or split across tokens: ASCII, multi-byte characters
# (whose bytes some tokens split), the end-of-turn tokens.
_TEXT = "ab e\nab éé 日本語 aé\n e a\nb 😀 ba"
_BYTES = [chat_tokenizer().encode_single_token(bytes([b])) for b in "é😀日".encode()]  # split characters
POOL = sorted({*chat.encode(_TEXT), *_BYTES, IM_END, ENDOFTEXT, 15, 220, 198})
IDS = st.lists(st.one_of(st.sampled_from(POOL), st.integers(0, QWEN3_VOCAB - 1)), max_size=24)
STOPS = st.lists(st.text(alphabet="ab e\né日😀", max_size=3), max_size=4)


@settings(max_examples=400, deadline=None)
@given(IDS, STOPS, st.lists(st.sampled_from(POOL), max_size=2))
def test_the_cut_returns_no_stop_string_a_prefix_of_the_text_and_ids_that_decode_to_it(
    ids: list[int], stops: list[str], stop_ids: list[int]
) -> None:
    full = chat.reply_text(ids)
    cut = openai_api.cut_at_stop(ids, stops, stop_ids)
    live = [s for s in stops if s]
    if cut is None:
        assert not any(s in full for s in live) and not set(stop_ids) & set(ids)
        return
    assert 1 <= cut.keep <= len(ids)
    assert not any(s in cut.text for s in live)
    assert full.startswith(cut.text)
    assert chat.decode(ids[: cut.keep]).startswith(cut.text)
    # The last id kept is the one that completed the stop: none is complete before it.
    before = ids[: cut.keep - 1]
    assert not any(s in chat.decode(before) for s in live) and not set(stop_ids) & set(before)


def test_the_cut_keeps_the_token_that_completes_the_stop_string() -> None:
    ids = chat.encode("Hello world. The end")
    cut = openai_api.cut_at_stop(ids, ["world", "The"], [])
    assert cut is not None and cut.text == "Hello "
    assert chat.decode(ids[: cut.keep]) == "Hello world"  # " world" completes it; nothing after is kept
    assert openai_api.cut_at_stop(ids, ["nowhere"], []) is None
    # An end-of-turn token has no text: a stop string is looked for before it, and a stop id is kept.
    assert openai_api.cut_at_stop([*ids, IM_END], ["xyz"], []) is None
    cut = openai_api.cut_at_stop(ids, [], [ids[2]])
    assert cut is not None and cut.keep == 3 and cut.text == chat.decode(ids[:2])


def _generated(
    ids: list[int], top: list[list[tuple[int, float]]] | None, rid: str = "r"
) -> openai_api.Generated:
    return openai_api.Generated(rid, "m", 1, "stop", [1, 2], ids, [-0.5] * len(ids), True, top)


def test_top_logprobs_read_as_openais_for_chat_and_completions() -> None:
    ids = chat.encode("Hi there")
    top = [[(t, -0.5), (t + 1, -1.5), (t + 2, -2.5)] for t in ids]
    body = openai_api.chat_completion(_generated(ids, top), chat.Reply("Hi there", []))
    c = ChatCompletion.model_validate(body).choices[0]
    assert c.logprobs is not None and c.logprobs.content is not None
    for entry, t, row in zip(c.logprobs.content, ids, top, strict=True):
        assert [a.logprob for a in entry.top_logprobs] == [-0.5, -1.5, -2.5]
        assert entry.top_logprobs[1].bytes == list(chat_bytes(t + 1))
        assert entry.top_logprobs[0].token == entry.token and len(row) == 3
    # Without top_logprobs each token's list is empty, as OpenAI's.
    plain = ChatCompletion.model_validate(
        openai_api.chat_completion(_generated(ids, None), chat.Reply("Hi there", []))
    ).choices[0]
    assert plain.logprobs is not None and all(e.top_logprobs == [] for e in plain.logprobs.content or [])
    text = openai_api.text_completion(_generated(ids, top), "Hi there")
    lps = Completion.model_validate(text).choices[0].logprobs
    assert lps is not None and lps.top_logprobs is not None and len(lps.top_logprobs) == len(ids)
    first = lps.top_logprobs[0]
    assert list(first.values()) == [-0.5, -1.5, -2.5] and next(iter(first)) == chat.decode([ids[0]])
    assert (
        openai_api.text_completion(_generated(ids, None), "x")["choices"][0]["logprobs"]["top_logprobs"]
        is None
    )


def chat_bytes(t: int) -> bytes:
    return chat_tokenizer().decode_single_token_bytes(t)


def test_n_samples_are_one_response_with_choices_streamed_choice_after_choice() -> None:
    a, b = chat.encode("one"), chat.encode("two words")
    body = openai_api.choices(
        [
            openai_api.chat_completion(_generated(a, None, "r"), chat.Reply("one", [])),
            openai_api.chat_completion(_generated(b, None, "r.s1"), chat.Reply("two words", [])),
        ]
    )
    r = ChatCompletion.model_validate(body)
    assert [c.index for c in r.choices] == [0, 1] and r.id == "chatcmpl-r"
    assert [c.message.content for c in r.choices] == ["one", "two words"]
    assert r.usage is not None and r.usage.completion_tokens == len(a) + len(b) and r.usage.prompt_tokens == 2
    assert [c.model_extra["token_ids"] for c in r.choices] == [a, b]  # type: ignore[index]
    chunks = [ChatCompletionChunk.model_validate(c) for c in openai_api.chunks(body, include_usage=True)]
    content: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for ch in chunks:
        for c in ch.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert content == {0: "one", 1: "two words"} and finish == {0: "stop", 1: "stop"}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(a) + len(b)


def test_the_requests_take_stop_n_and_top_logprobs_within_openais_bounds() -> None:
    ok = from_json(json.dumps({"stop": "x", "n": 4, "logprobs": True, "top_logprobs": 5}), ChatRequest)
    assert ok.stops() == ["x"] and ok.top() == 5 and ok.unsupported() is None
    assert from_json(b'{"stop": ["a", "", "b"]}', ChatRequest).stops() == ["a", "b"]
    for bad in ({"stop": ["a", "b", "c", "d", "e"]}, {"n": 0}, {"n": 17}, {"top_logprobs": 21}):
        with pytest.raises(msgspec.ValidationError):
            from_json(json.dumps(bad), ChatRequest)
    assert str(from_json(b'{"top_logprobs": 2}', ChatRequest).unsupported()).startswith("top_logprobs:")
    done = from_json(b'{"logprobs": 3}', CompletionRequest)
    assert done.top() == 3 and done.unsupported() is None
    assert str(from_json(b'{"echo": true}', CompletionRequest).unsupported()).startswith("echo:")
    assert from_json(b'{"stop_token_ids": [7, 8]}', CompletionRequest).stop_token_ids == [7, 8]


def test_the_simulated_engine_gives_top_alternatives_and_stops_at_a_stop_id() -> None:
    prompt = [5, 6, 7]
    base = _with_ids(
        EngineRequest("r", 3, 20, input_ids=prompt, return_logprob=True),
        EngineOutput("r", 20, "length"),
    )
    assert (
        base.output_ids is not None and base.output_logprobs is not None and base.output_top_logprobs is None
    )
    top = _with_ids(
        EngineRequest("r", 3, 20, input_ids=prompt, return_logprob=True, top_logprobs=4),
        EngineOutput("r", 20, "length"),
    )
    assert top.output_ids == base.output_ids and top.output_top_logprobs is not None
    for t, lp, row in zip(top.output_ids, base.output_logprobs, top.output_top_logprobs, strict=True):
        lps = [x[1] for x in row]
        assert len(row) == 4 and (t, lp) in row and lps == sorted(lps, reverse=True)
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-9 and len({x[0] for x in row}) == 4
    stop = base.output_ids[6]
    cut = _with_ids(
        EngineRequest("r", 3, 20, input_ids=prompt, return_logprob=True, stop_token_ids=[stop]),
        EngineOutput("r", 20, "length"),
    )
    at = base.output_ids.index(stop)
    assert cut.output_ids == base.output_ids[: at + 1] and cut.finish_reason == "stop"
    assert cut.output_logprobs == base.output_logprobs[: at + 1] and cut.output_len == at + 1
    assert synth_top_logprobs("k", [], [], 3) == []


async def test_the_sglang_client_asks_for_top_logprobs_and_stop_ids() -> None:
    async with _backend() as (_, client):
        plain = await client.generate(
            EngineRequest("s.0", 8, 12, input_ids=list(range(8)), ignore_eos=True, return_logprob=True)
        )
        assert plain.output_ids is not None and plain.output_top_logprobs is None
        # The same request again (the same draws), asking for alternatives as well.
        out = await client.generate(
            EngineRequest("s.0", 8, 12, input_ids=list(range(8)), return_logprob=True, top_logprobs=3)
        )
        assert out.output_ids == plain.output_ids and out.output_top_logprobs is not None
        assert out.output_logprobs == plain.output_logprobs
        for t, lp, row in zip(
            out.output_ids, out.output_logprobs or [], out.output_top_logprobs, strict=True
        ):
            assert len(row) == 3 and ((t, lp) in row or lp < row[-1][1])
        stop = plain.output_ids[4]
        cut = await client.generate(
            EngineRequest("s.0", 8, 12, input_ids=list(range(8)), stop_token_ids=[stop], stop=["zz"])
        )
        at = plain.output_ids.index(stop)
        assert cut.output_ids == plain.output_ids[: at + 1] and cut.finish_reason == "stop"


async def test_the_transformers_engine_gives_the_top_alternatives_of_its_distribution(
    engine_at,  # noqa: F811
    models,  # noqa: F811
) -> None:
    engine: HFEngine = await engine_at("a")
    prompt = PROMPTS[1]
    out = await engine.generate(req("h.0", prompt, 6, temperature=0.7, top_logprobs=4))
    assert out.output_ids is not None and out.output_top_logprobs is not None
    logps = torch.log_softmax(full_logits(models["a"][1], prompt, out.output_ids) / 0.7, dim=-1)
    for i, row in enumerate(out.output_top_logprobs):
        vals, idx = logps[i].topk(4)
        assert {t for t, _ in row} == set(idx.tolist())
        assert [lp for _, lp in row] == pytest.approx(vals.tolist(), abs=1e-4)  # best first
    assert (await engine.generate(req("h.1", prompt, 6))).output_top_logprobs is None
    greedy = await engine.generate(req("h.2", prompt, 6))
    assert greedy.output_ids is not None
    stop = greedy.output_ids[2]
    cut = await engine.generate(req("h.3", prompt, 6, stop_token_ids=[stop]))
    at = greedy.output_ids.index(stop)
    assert cut.output_ids == greedy.output_ids[: at + 1] and cut.finish_reason == "stop"

"""The gateway's response objects, read back with the official `openai` package's own types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from loom.text import chat, openai_api
from loom.text.tokenizer import IM_END


def _reply_ids() -> list[int]:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    return [*chat.encode(text), IM_END]


def test_a_reply_with_a_tool_call_is_an_openai_chat_completion_with_tool_calls() -> None:
    ids = _reply_ids()
    lps = [-0.5] * len(ids)
    reply = chat.parse_reply(chat.reply_text(ids))
    g = openai_api.Generated("r1", "qwen3-8b", 1, "tool_calls", [1, 2, 3], ids, lps, True)
    body = openai_api.chat_completion(g, reply)
    c = ChatCompletion.model_validate(body)
    (call,) = c.choices[0].message.tool_calls or []
    assert c.choices[0].message.content == "Let me compute."
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "2+2"})
    assert c.choices[0].finish_reason == "tool_calls" and c.usage and c.usage.total_tokens == 3 + len(ids)
    assert c.choices[0].logprobs and len(c.choices[0].logprobs.content or []) == len(ids)
    assert (
        b"".join(bytes(t.bytes or []) for t in c.choices[0].logprobs.content or [])
        == chat.decode(ids).encode()
    )
    assert c.model_extra and c.model_extra["prompt_token_ids"] == [1, 2, 3]
    # Sent back as the agent's history, the reply renders as the model wrote it.
    rendered = chat.render(
        [{"role": "user", "content": "q"}, c.choices[0].message.model_dump(exclude_none=True)]
    )
    assert chat.reply_text(ids) in rendered


def test_the_stream_of_a_reply_carries_its_content_calls_ids_and_usage() -> None:
    ids = _reply_ids()
    reply = chat.parse_reply(chat.reply_text(ids))
    g = openai_api.Generated("r1", "m", 1, "tool_calls", [7], ids, [-1.0] * len(ids), True)
    body = openai_api.chat_completion(g, reply)
    chunks = [ChatCompletionChunk.model_validate(c) for c in openai_api.chunks(body, include_usage=True)]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].model_extra["prompt_token_ids"] == [7]
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert content == "Let me compute." and [t.function.name for t in calls if t.function] == ["calculator"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage and chunks[-1].usage.completion_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_completion_reads_as_openais(stream: bool) -> None:
    ids = chat.encode("four")
    g = openai_api.Generated("r2", "m", 1, "length", [5, 6], ids, [-0.25] * len(ids), False)
    body = openai_api.text_completion(g, "four")
    if stream:
        # Mid-stream chunks have no finish reason yet, which the SDK reads without validating (as OpenAI's).
        first, last = openai_api.chunks(body, include_usage=False)
        assert first["choices"][0]["text"] == "four" and first["choices"][0]["finish_reason"] is None
        assert Completion.model_validate(last).choices[0].finish_reason == "length"
    else:
        c = Completion.model_validate(body)
        assert (
            c.choices[0].logprobs
            and c.choices[0].logprobs.tokens
            and "".join(c.choices[0].logprobs.tokens) == "four"
        )
        assert c.choices[0].logprobs.token_logprobs == [-0.25] * len(ids)

"""Qwen3's chat template in ids: rendering, continuation and the tool-call parser."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.text import chat
from loom.text.tokenizer import IM_END, IM_START

TOOLS = [{"type": "function", "function": {"name": "guess", "parameters": {"type": "object"}}}]


def test_render_writes_qwen3s_template_with_tools_and_tool_results() -> None:
    messages = [
        {"role": "system", "content": "Play."},
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "guess", "arguments": '{"n": 1}'}}
            ],
        },
        {"role": "tool", "content": "higher"},
        {"role": "tool", "content": "again"},
    ]
    assert chat.render(messages, TOOLS) == (
        "<|im_start|>system\nPlay.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "guess", "parameters": {"type": "object"}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nGo<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "guess", "arguments": {"n": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nhigher\n</tool_response>\n<tool_response>\nagain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = chat.encode(chat.render(messages[:2]))
    assert ids[0] == IM_START and ids.count(IM_END) == 2  # markers are single tokens


def test_old_reasoning_is_dropped_and_recent_kept_as_the_template_does() -> None:
    turn = {"role": "assistant", "content": "<think>\nhm\n</think>\n\nA"}
    old = chat.render([{"role": "user", "content": "q"}, turn, {"role": "user", "content": "r"}], None, False)
    assert "<|im_start|>assistant\nA<|im_end|>" in old
    recent = chat.render([{"role": "user", "content": "q"}, turn], None, False)
    assert recent.endswith("<|im_start|>assistant\n<think>\nhm\n</think>\n\nA<|im_end|>\n")


def test_bad_messages_are_clear_errors() -> None:
    with pytest.raises(chat.ChatError, match="role"):
        chat.render([{"content": "x"}])
    with pytest.raises(chat.ChatError, match="text content parts"):
        chat.render([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(chat.ChatError, match="engine's to generate"):
        chat.continuation([{"role": "assistant", "content": "x"}], ended=True)


def test_parse_reply_reads_calls_and_leaves_bad_json_in_the_content() -> None:
    r = chat.parse_reply('Let me try.\n<tool_call>\n{"name": "guess", "arguments": {"n": 50}}\n</tool_call>')
    assert r.content == "Let me try." and [
        (c.function.name, json.loads(c.function.arguments)) for c in r.tool_calls
    ] == [("guess", {"n": 50})]
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert chat.parse_reply(bad) == chat.Reply(bad, [])
    assert chat.message(chat.parse_reply("hi")) == {"role": "assistant", "content": "hi"}


_text = st.text(st.characters(codec="utf-8", exclude_characters="<>"), max_size=20)
_args = st.dictionaries(
    st.text(st.characters(codec="ascii", categories=["L"]), min_size=1, max_size=5), st.integers(), max_size=3
)
_call = st.builds(
    lambda n, a: {"function": {"name": n, "arguments": a}}, st.sampled_from(["guess", "sh"]), _args
)


@settings(max_examples=150, deadline=None)
@given(
    content=_text,
    calls=st.lists(_call, max_size=3),
    observations=st.lists(_text, min_size=1, max_size=3),
    as_tool=st.booleans(),
)
def test_a_context_grown_by_ids_is_the_template_of_the_whole_chat(
    content: str, calls: list[dict[str, Any]], observations: list[str], as_tool: bool
) -> None:
    """Prompt, then the reply as generated, then its continuation, is the template over the whole chat:
    what a trajectory records turn by turn is what rendering it whole would give, and the parser gets the
    calls back."""
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    reply = {"role": "assistant", "content": content, "tool_calls": calls}
    generated = chat._assistant(reply, recent=False, last=False).removesuffix("<|im_end|>\n") + "<|im_end|>"
    follow = [{"role": "tool" if as_tool else "user", "content": o} for o in observations]
    grown = chat.render(head, TOOLS) + generated.removeprefix("<|im_start|>assistant\n")
    grown += chat.continuation(follow, ended=True)
    assert grown == chat.render([*head, reply, *follow], TOOLS)
    ids = chat.encode(generated.removeprefix("<|im_start|>assistant\n"))
    parsed = chat.parse_reply(chat.reply_text(ids))
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert chat.ended(ids)


def test_a_chat_to_learn_from_is_its_template_with_the_loss_on_the_assistant_turns() -> None:
    from loom.trainer.chat_sft import chat_sequence

    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "guess", "arguments": {"n": 3}}}],
    }
    messages = [
        {"role": "user", "content": "Go"},
        call,
        {"role": "tool", "content": "higher"},
        {"role": "assistant", "content": "Done."},
    ]
    flat = chat_sequence(messages, TOOLS)
    ids, mask = flat.ids.tolist(), flat.loss_mask.tolist()
    # The chat as the template renders it once a later query follows (which leaves no empty thought in
    # the last turn: the model writes none after the generation prompt).
    later = chat.render([*messages, {"role": "user", "content": "?"}], TOOLS, add_generation_prompt=False)
    assert later.startswith(chat.decode(ids) + "\n")
    learned = chat.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert learned == chat.assistant_text(call) + "<|im_end|>" + "Done.<|im_end|>"
    with pytest.raises(ValueError, match="assistant turns"):
        chat_sequence(messages[:1])

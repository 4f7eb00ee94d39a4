"""Qwen3's chat template, its tool-call format, and chats as token ids.

``render`` writes OpenAI-style messages (and tools as OpenAI function schemas) the way Qwen3's Jinja chat
template does, so that a prompt built here is the prompt the model was trained on; ``parse_reply`` reads a
reply back the way SGLang's and vLLM's Qwen tool parsers do (``<tool_call>{json}</tool_call>`` blocks, text
before the first one is the content). Token ids come from Qwen's tokenizer with its added tokens, so the
chat markers and tool-call tags are single tokens, as the engine sees them.

A multi-turn context grows by ids, never by rendering the whole chat again: the engine's output ids are
kept as produced, and what follows them (the end of the turn, tool results, the next generation prompt)
is ``continuation``'s text.
"""

from __future__ import annotations

import json
import re
import unicodedata
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import Struct

from loom.text.tokenizer import ENDOFTEXT, IM_END, chat_tokenizer

Message = dict[str, Any]

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_STOPS = frozenset({ENDOFTEXT, IM_END})
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """Messages or tools the template cannot render (an agent's bad request, answered 400)."""


class FunctionCall(Struct, frozen=True):
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


class ToolCall(Struct, frozen=True):
    id: str
    function: FunctionCall
    type: str = "function"


class Reply(Struct, frozen=True):
    """A model's reply as the OpenAI API returns it: the content, and the tool calls it made."""

    content: str
    tool_calls: list[ToolCall]


def tojson(value: Any) -> str:
    # Jinja's tojson as transformers' chat templates define it: no ASCII escaping, default separators.
    return json.dumps(value, ensure_ascii=False)


def text_of(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI content parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ChatError("only text content parts are supported: {'type': 'text', 'text': ...}")
            parts.append(p["text"])
        return "".join(parts)
    raise ChatError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def joined_text(messages: Sequence[Message]) -> str:
    """The text of messages, one per line (what a trajectory records as a step's observation)."""
    return "\n".join(text_of(m.get("content")) for m in messages)


def _check(messages: Sequence[Message]) -> None:
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatError(f"messages[{n}] needs a role, one of {', '.join(ROLES)}")


def _is_tool_response(m: Message) -> bool:
    c = text_of(m.get("content"))
    return c.startswith("<tool_response>") and c.endswith("</tool_response>")


def _call_text(call: Any) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatError("a tool call is {'function': {'name': ..., 'arguments': ...}}")
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else tojson(args)
    return f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {args_text}}}\n</tool_call>'


def _assistant(m: Message, recent: bool, last: bool) -> str:
    content = text_of(m.get("content"))
    reasoning = m.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:
            head, _, _ = content.partition("</think>")
            content = content.split("</think>")[-1].lstrip("\n")
            reasoning = head.rstrip("\n").split("<think>")[-1].lstrip("\n")
    # Only turns after the last real user query keep their reasoning (the template drops older thoughts).
    if recent and (last or reasoning):
        out = f"<|im_start|>assistant\n<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    else:
        out = f"<|im_start|>assistant\n{content}"
    for k, call in enumerate(m.get("tool_calls") or ()):
        if k or content:
            out += "\n"
        out += _call_text(call)
    return out + "<|im_end|>\n"


def assistant_text(m: Message) -> str:
    """An assistant message as the model writes it after the generation prompt (without its end token)."""
    return (
        _assistant(m, recent=False, last=False)
        .removeprefix("<|im_start|>assistant\n")
        .removesuffix("<|im_end|>\n")
    )


def _turns(messages: Sequence[Message], skip_first_system: bool) -> str:
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and not _is_tool_response(messages[i]):
            last_query = i
            break
    out = []
    n = len(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user" or (role == "system" and not (i == 0 and skip_first_system)):
            out.append(f"<|im_start|>{role}\n{text_of(m.get('content'))}<|im_end|>\n")
        elif role == "assistant":
            out.append(_assistant(m, i > last_query, i == n - 1))
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{text_of(m.get('content'))}\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")
    return "".join(out)


def _generation_prompt(enable_thinking: bool) -> str:
    return "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")


def render(
    messages: Sequence[Message],
    tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
) -> str:
    """The prompt Qwen3's chat template makes of ``messages`` (and ``tools``, OpenAI function schemas)."""
    _check(messages)
    if not messages:
        raise ChatError("a chat needs at least one message")
    system = messages[0]["role"] == "system"
    head = ""
    if tools:
        head = "<|im_start|>system\n"
        if system:
            head += text_of(messages[0].get("content")) + "\n\n"
        head += _TOOLS_HEAD + "".join("\n" + tojson(t) for t in tools) + _TOOLS_TAIL
    elif system:
        head = f"<|im_start|>system\n{text_of(messages[0].get('content'))}<|im_end|>\n"
    tail = _generation_prompt(enable_thinking) if add_generation_prompt else ""
    return head + _turns(messages, skip_first_system=True) + tail


def continuation(messages: Sequence[Message], ended: bool, enable_thinking: bool = True) -> str:
    """What follows an assistant turn the engine produced: the turn's end (``<|im_end|>`` too when the
    engine stopped at a length limit rather than at it), ``messages`` (tool results, user turns), and the
    next generation prompt."""
    _check(messages)
    if any(m["role"] == "assistant" for m in messages):
        raise ChatError("an assistant turn is the engine's to generate, not to append")
    return (
        ("" if ended else "<|im_end|>") + "\n" + _turns(messages, False) + _generation_prompt(enable_thinking)
    )


def encode(text: str) -> list[int]:
    # Qwen's tokenizer normalises text to NFC before it splits it.
    return chat_tokenizer().encode(unicodedata.normalize("NFC", text), allowed_special="all")


def decode(ids: Sequence[int]) -> str:
    """The text of ids; ids the tokenizer has no piece for (the embedding's padding rows, which a barely
    trained model may still sample) read as nothing."""
    enc = chat_tokenizer()
    return enc.decode([t for t in ids if 0 <= t < enc.n_vocab])


def reply_text(output_ids: Sequence[int]) -> str:
    """The text of a reply's ids without the token that ended it."""
    ids = list(output_ids)
    if ids and ids[-1] in _STOPS:
        ids.pop()
    return decode(ids)


def ended(output_ids: Sequence[int]) -> bool:
    """Whether the engine ended the turn itself (a stop token) rather than at a length limit."""
    return bool(output_ids) and output_ids[-1] in _STOPS


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_reply(text: str) -> Reply:
    """A reply's content and tool calls: each ``<tool_call>`` block whose JSON names a function is a call
    (its arguments re-serialised as JSON text); the content is the text before the first call. A block
    that is not such JSON is left in the content, as SGLang's Qwen parser does."""
    calls: list[ToolCall] = []
    first: int | None = None
    for m in _TOOL_CALL.finditer(text):
        try:
            d = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            continue
        args = d.get("arguments", d.get("parameters", {}))
        calls.append(
            ToolCall(call_id(), FunctionCall(d["name"], args if isinstance(args, str) else tojson(args)))
        )
        if first is None:
            first = m.start()
    content = text if first is None else text[:first].rstrip("\n")
    return Reply(content, calls)


def message(reply: Reply) -> Message:
    """The assistant message of a reply, as an OpenAI chat completion carries it."""
    out: Message = {"role": "assistant", "content": reply.content or (None if reply.tool_calls else "")}
    if reply.tool_calls:
        out["tool_calls"] = msgspec.to_builtins(reply.tool_calls)
    return out

"""OpenAI API response objects for a session's replies: chat completions, text completions, and the chunks
of their streamed form (``data: {...}`` server-sent events ending ``data: [DONE]``). Token ids travel as vLLM
returns them with ``return_token_ids``: ``prompt_token_ids`` beside the choices, ``token_ids`` in each."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from loom import chat
from loom.tokenizer import chat_tokenizer


def error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error"}.get(
        status, "api_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _pieces(ids: Sequence[int]) -> list[bytes]:
    enc = chat_tokenizer()
    return [enc.decode_single_token_bytes(t) if 0 <= t < enc.n_vocab else b"" for t in ids]


def chat_logprobs(ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b), "top_logprobs": []}
            for b, lp in zip(_pieces(ids), logprobs, strict=True)
        ]
    }


def completion_logprobs(ids: Sequence[int], logprobs: Sequence[float]) -> dict[str, Any]:
    tokens = [b.decode("utf-8", "replace") for b in _pieces(ids)]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "text_offset": offsets, "top_logprobs": None}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Generated:
    """One call's generation, as every response object reports it."""

    rid: str
    model: str
    created: int
    finish: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    logprobs: Sequence[float] | None  # None: the caller did not ask for them
    token_ids: bool  # vLLM's return_token_ids


def _response(g: Generated, obj: str, prefix: str, choice: dict[str, Any]) -> dict[str, Any]:
    choice = {"index": 0, **choice, "finish_reason": g.finish}
    out: dict[str, Any] = {
        "id": f"{prefix}-{g.rid}",
        "object": obj,
        "created": g.created,
        "model": g.model,
        "choices": [choice],
        "usage": usage(len(g.prompt_ids), len(g.output_ids)),
    }
    if g.token_ids:
        choice["token_ids"] = list(g.output_ids)
        out["prompt_token_ids"] = list(g.prompt_ids)
    return out


def chat_completion(g: Generated, reply: chat.Reply) -> dict[str, Any]:
    lps = chat_logprobs(g.output_ids, g.logprobs) if g.logprobs is not None else None
    return _response(g, "chat.completion", "chatcmpl", {"message": chat.message(reply), "logprobs": lps})


def text_completion(g: Generated, text: str) -> dict[str, Any]:
    lps = completion_logprobs(g.output_ids, g.logprobs) if g.logprobs is not None else None
    return _response(g, "text_completion", "cmpl", {"text": text, "logprobs": lps})


def chunks(response: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """A finished response as the chunks of its stream. The engine reports a generation when it ends, so
    the content comes in one chunk (tool calls in the next), then the finish reason, then the usage."""
    choice = response["choices"][0]
    head = {k: response[k] for k in ("id", "created", "model")}
    is_chat = response["object"] == "chat.completion"
    head["object"] = "chat.completion.chunk" if is_chat else "text_completion"

    def chunk(delta: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None, **extra}
        if is_chat:
            c["delta"] = delta or {}
        else:
            c.setdefault("text", "")
        return {**head, "choices": [c]}

    if is_chat:
        message = choice["message"]
        first = chunk({"role": "assistant", "content": ""})
        if "prompt_token_ids" in response:
            first["prompt_token_ids"] = response["prompt_token_ids"]
        yield first
        body = chunk({"content": message["content"] or ""}, logprobs=choice["logprobs"])
        if "token_ids" in choice:
            body["choices"][0]["token_ids"] = choice["token_ids"]
        yield body
        if message.get("tool_calls"):
            calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            yield chunk({"tool_calls": calls})
    else:
        body = chunk(None, text=choice["text"], logprobs=choice["logprobs"])
        if "prompt_token_ids" in response:
            body["prompt_token_ids"] = response["prompt_token_ids"]
        if "token_ids" in choice:
            body["choices"][0]["token_ids"] = choice["token_ids"]
        yield body
    yield chunk(None, finish_reason=choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}

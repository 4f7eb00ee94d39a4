"""OpenAI API response objects for a session's replies: chat completions, text completions, and the chunks
of their streamed form (``data: {...}`` server-sent events ending ``data: [DONE]``). Token ids travel as vLLM
returns them with ``return_token_ids``: ``prompt_token_ids`` beside the choices, ``token_ids`` in each."""

from __future__ import annotations

import codecs
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from loom.text import chat
from loom.text.tokenizer import chat_tokenizer


def error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error"}.get(
        status, "api_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# Each output token's top alternatives, most likely first: (token id, log-prob).
TopLogprobs = Sequence[Sequence[tuple[int, float]]]


def _piece(t: int) -> bytes:
    enc = chat_tokenizer()
    return enc.decode_single_token_bytes(t) if 0 <= t < enc.n_vocab else b""


def _pieces(ids: Sequence[int]) -> list[bytes]:
    return [_piece(t) for t in ids]


def _alternative(b: bytes, lp: float) -> dict[str, Any]:
    return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}


def chat_logprobs(
    ids: Sequence[int], logprobs: Sequence[float], top: TopLogprobs | None = None
) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: each output token with its log-prob and, given ``top`` (the engine's top
    alternatives per token, best first), its ``top_logprobs``."""
    rows: list[list[dict[str, Any]]] = [[] for _ in ids]
    if top is not None:
        rows = [[_alternative(_piece(t), lp) for t, lp in r] for r in top]
    return {
        "content": [
            {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b), "top_logprobs": row}
            for b, lp, row in zip(_pieces(ids), logprobs, rows, strict=True)
        ]
    }


def completion_logprobs(
    ids: Sequence[int], logprobs: Sequence[float], top: TopLogprobs | None = None
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs``; ``top_logprobs`` (given ``top``) maps each alternative's text to its
    log-prob, one mapping per output token, as OpenAI's does (alternatives of the same text collapse)."""
    tokens = [b.decode("utf-8", "replace") for b in _pieces(ids)]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops: list[dict[str, float]] | None = None
    if top is not None:
        # Worst first, so that the best of the alternatives that read the same is the one kept.
        tops = [{_piece(t).decode("utf-8", "replace"): lp for t, lp in reversed(r)} for r in top]
        tops = [dict(sorted(d.items(), key=lambda kv: -kv[1])) for d in tops]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "text_offset": offsets, "top_logprobs": tops}


@dataclass(frozen=True)
class Cut:
    """Where an agent's stop ended a turn: the output ids recorded (``keep``, every id up to and including
    the one that completed the first stop string, or the first stop id) and the text returned (before the
    stop string, which is not returned, as OpenAI's is not)."""

    keep: int
    text: str


def cut_at_stop(output_ids: Sequence[int], stop: Sequence[str], stop_ids: Sequence[int] = ()) -> Cut | None:
    """The first stop in an output, as an engine that checks after each token finds it; None: none is there.

    The text is decoded once, incrementally token by token (as one decode of all the ids reads it), and the
    stop string whose first occurrence ends earliest wins: the token whose bytes complete it is the last one
    kept, and the text returned ends where that occurrence begins. So the text returned contains no stop
    string, is a prefix of the whole output's text, and the ids kept decode to at least it; ids are never
    re-tokenised. A stop id ends the output at the first one (kept, its own text not returned)."""
    ids = list(output_ids)
    keep: int | None = None
    if stop_ids:
        wanted = set(stop_ids)
        first = next((i for i, t in enumerate(ids) if t in wanted), None)
        if first is not None:
            ids, keep = ids[:first], first + 1
    if keep is None and chat.ended(ids):
        ids = ids[:-1]  # the end-of-turn token has no text, as ``chat.reply_text`` reads it
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    emitted = [decoder.decode(b) for b in _pieces(ids)]
    text = "".join(emitted) + decoder.decode(b"", final=True)
    end = start = -1
    for s in stop:
        at = text.find(s) if s else -1
        if at >= 0 and (end < 0 or (at + len(s), at) < (end, start)):
            end, start = at + len(s), at
    if end < 0:
        if keep is None:
            return None
        return Cut(keep, "".join(emitted))  # the text before the stop id (an unfinished character dropped)
    chars = 0
    for i, piece in enumerate(emitted):
        chars += len(piece)
        if chars >= end:
            return Cut(i + 1, text[:start])
    return Cut(len(ids), text[:start])  # completed only by the replacement of an unfinished character


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
    top: TopLogprobs | None = None  # each output token's top alternatives, when the caller asked for them


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
    lps = chat_logprobs(g.output_ids, g.logprobs, g.top) if g.logprobs is not None else None
    return _response(g, "chat.completion", "chatcmpl", {"message": chat.message(reply), "logprobs": lps})


def text_completion(g: Generated, text: str) -> dict[str, Any]:
    lps = completion_logprobs(g.output_ids, g.logprobs, g.top) if g.logprobs is not None else None
    return _response(g, "text_completion", "cmpl", {"text": text, "logprobs": lps})


def choices(responses: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The responses of one call's ``n`` samples (each made alone) as one response: the first's id and
    prompt, their choices indexed 0 to n-1, the usage of all of them (the prompt counted once)."""
    first = responses[0]
    out = {**first, "choices": [{**r["choices"][0], "index": i} for i, r in enumerate(responses)]}
    prompt = first["usage"]["prompt_tokens"]
    out["usage"] = usage(prompt, sum(r["usage"]["completion_tokens"] for r in responses))
    return out


def chunks(response: dict[str, Any], include_usage: bool) -> Iterator[dict[str, Any]]:
    """A finished response as the chunks of its stream. The engine reports a generation when it ends, so
    each choice's content comes in one chunk (tool calls in the next), then its finish reason, choice after
    choice; then the usage."""
    head = {k: response[k] for k in ("id", "created", "model")}
    is_chat = response["object"] == "chat.completion"
    head["object"] = "chat.completion.chunk" if is_chat else "text_completion"
    first_chunk = True

    for choice in response["choices"]:
        index = choice["index"]

        def chunk(delta: dict[str, Any] | None, index: int = index, **extra: Any) -> dict[str, Any]:
            c: dict[str, Any] = {"index": index, "logprobs": None, "finish_reason": None, **extra}
            if is_chat:
                c["delta"] = delta or {}
            else:
                c.setdefault("text", "")
            return {**head, "choices": [c]}

        if is_chat:
            message = choice["message"]
            opening = chunk({"role": "assistant", "content": ""})
            if first_chunk and "prompt_token_ids" in response:
                opening["prompt_token_ids"] = response["prompt_token_ids"]
            yield opening
            body = chunk({"content": message["content"] or ""}, logprobs=choice["logprobs"])
            if "token_ids" in choice:
                body["choices"][0]["token_ids"] = choice["token_ids"]
            yield body
            if message.get("tool_calls"):
                calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
                yield chunk({"tool_calls": calls})
        else:
            body = chunk(None, text=choice["text"], logprobs=choice["logprobs"])
            if first_chunk and "prompt_token_ids" in response:
                body["prompt_token_ids"] = response["prompt_token_ids"]
            if "token_ids" in choice:
                body["choices"][0]["token_ids"] = choice["token_ids"]
            yield body
        first_chunk = False
        yield chunk(None, finish_reason=choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def generate_response(samples: Sequence[Generated]) -> dict[str, Any]:
    """One call's samples as vLLM's token-in, token-out ``/inference/v1/generate`` answers: the prompt's ids, and
    per choice its ids, finish reason and ``logprobs.content``, one entry per output id named ``token_id:N``
    (as verifiers' renderers read it) with its top alternatives."""
    first = samples[0]
    choices = []
    for i, g in enumerate(samples):
        content = None
        if g.logprobs is not None:
            tops: Sequence[Sequence[tuple[int, float]] | None] = g.top or [None] * len(g.output_ids)
            content = [
                {
                    "token": f"token_id:{t}",
                    "token_id": t,
                    "logprob": lp,
                    "top_logprobs": [
                        {"token": f"token_id:{a}", "token_id": a, "logprob": alp} for a, alp in top or ()
                    ],
                }
                for t, lp, top in zip(g.output_ids, g.logprobs, tops, strict=True)
            ]
        choices.append(
            {
                "index": i,
                "token_ids": list(g.output_ids),
                "finish_reason": g.finish,
                "logprobs": {"content": content} if content is not None else None,
            }
        )
    return {
        "request_id": f"generate-tokens-{first.rid}",
        "prompt_token_ids": list(first.prompt_ids),
        "choices": choices,
        "usage": usage(len(first.prompt_ids), sum(len(g.output_ids) for g in samples)),
    }

"""Parse a model's output into a tool call: ReAct text (``Action: Search[x]``) or a JSON tool call.

JSON tool calls are accepted the way Qwen3's chat template emits them (``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``) and as a bare JSON object. The last call in the text wins, as in
ReAct, where a thought may quote earlier actions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from msgspec import Struct

_REACT = re.compile(r"(?:Action(?:\s*\d+)?\s*:\s*)?\b([A-Z][A-Za-z_]*)\[(.*)\]\s*$", re.S)
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_FENCE = re.compile(r"```(?:json)?\s*(\{.*\})\s*```", re.S)


class ToolCall(Struct, frozen=True):
    name: str
    arguments: dict[str, Any]


class ParseError(ValueError):
    pass


def _json_call(blob: str) -> ToolCall:
    try:
        d = json.loads(blob)
    except json.JSONDecodeError as e:
        raise ParseError(f"tool call is not valid JSON: {e.msg} at {e.pos}") from e
    if not isinstance(d, dict) or not isinstance(d.get("name"), str):
        raise ParseError('a tool call is {"name": ..., "arguments": {...}}')
    args = d.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments JSON-encoded once more
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ParseError("tool call arguments are not a JSON object") from e
    if not isinstance(args, dict):
        raise ParseError("tool call arguments are not a JSON object")
    return ToolCall(d["name"], args)


def parse(text: str) -> ToolCall:
    """The tool call in a model's output; ParseError (with what was wrong) when there is none."""
    calls = _TOOL_CALL.findall(text)
    if calls:
        return _json_call(calls[-1])
    fenced = _FENCE.findall(text)
    if fenced:
        return _json_call(fenced[-1])
    stripped = text.strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        return _json_call(stripped)
    for line in reversed(stripped.splitlines()):
        m = _REACT.search(line.strip())
        if m:
            return ToolCall(m.group(1), {"input": m.group(2)})
    raise ParseError("no action found: expected 'Action: Tool[input]' or a <tool_call> JSON object")


def invalid(error: ParseError) -> str:
    """The observation an environment loop answers a call it cannot parse with (the turn is spent, the
    trajectory goes on)."""
    return f"Invalid action: {error}"


def json_call(name: str, **arguments: Any) -> str:
    """How a scripted action is written: the Qwen3 tool-call format."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

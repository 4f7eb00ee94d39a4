"""What the importers share: a stable name for a prompt, and a response's turns read from its loss mask."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def group_name(prompt: str | bytes) -> str:
    """A prompt's group: the same prompt at a later step is the same group again (its history)."""
    key = prompt.encode() if isinstance(prompt, str) else prompt
    return "p" + hashlib.sha1(key).hexdigest()[:12]


def mask_turns(prompt_tokens: int, mask: Sequence[int]) -> list[tuple[int, int, bool]]:
    """The model calls in a response whose loss mask is ``mask`` (1: a token the model generated, 0: one the
    environment returned), as (context tokens, output tokens, an observation followed) per call.

    This is how slime and SkyRL lay a multi-turn trajectory into one sequence: a run of 1s is one call, whose
    context is the prompt and every response token before it; a run of 0s after it is what its tool call
    returned. Observation tokens before the first call count as context. A response of no generated token is
    one call of 0 tokens (the engine was asked and stopped at once)."""
    turns: list[tuple[int, int, bool]] = []
    start = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            turns.append((prompt_tokens + start, i - start, i < len(mask)))
            start = None
    return turns or [(prompt_tokens + len(mask), 0, False)]

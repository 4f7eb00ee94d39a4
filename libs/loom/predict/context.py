"""What the length predictor reads of a trajectory, the same at training time and in the service.

The context is the task statement (the prompt) and the pieces that followed it: each action and each tool
observation, oldest first. The model keeps the head of the prompt and the tail of the pieces, because the
task says what is asked and the latest steps say how far along the agent is; everything between is dropped.
Senders clip with the same functions, so a request stays small however long its trajectory has run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import tiktoken

PROMPT_CHARS = 8192
PIECES_CHARS = 16384
HEAD_TOKENS = 512
TAIL_TOKENS = 1536
# Step, tokens generated so far and context length, log-scaled: a small model cannot count 30K tokens.
N_FEATURES = 3


def clip_prompt(prompt: str) -> str:
    return prompt[:PROMPT_CHARS]


def clip_pieces(pieces: Sequence[str]) -> list[str]:
    """The newest whole pieces whose characters fit in ``PIECES_CHARS``; the newest is always kept, cut to
    its last ``PIECES_CHARS`` characters if it alone is longer."""
    if not pieces:
        return []
    kept = [pieces[-1][-PIECES_CHARS:]]
    used = len(kept[0])
    for p in reversed(pieces[:-1]):
        if used + len(p) > PIECES_CHARS:
            break
        kept.append(p)
        used += len(p)
    kept.reverse()
    return kept


def step_pieces(actions: Sequence[str], observations: Sequence[str], step: int) -> list[str]:
    """The pieces after ``step`` model calls, while the last call's tool runs: every earlier action and
    observation, then the newest action, whose observation has not come back yet."""
    out: list[str] = []
    for i in range(step):
        out.append(actions[i] + "\n")
        if i < step - 1:
            out.append(observations[i] + "\n")
    return out


def features(step: int, generated: int, context_len: int) -> np.ndarray:
    return np.array(
        [math.log1p(step), math.log1p(generated) / 10.0, math.log1p(context_len) / 10.0], dtype=np.float32
    )


def window(prompt_ids: Sequence[int], piece_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Token ids the model reads: the prompt's first ``HEAD_TOKENS`` and the pieces' last ``TAIL_TOKENS``."""
    tail: list[int] = []
    for ids in reversed(piece_ids):
        tail[:0] = ids
        if len(tail) >= TAIL_TOKENS:
            break
    head = list(prompt_ids[:HEAD_TOKENS])
    return np.array(head + tail[-TAIL_TOKENS:] if tail else head, dtype=np.int64)


def encode(
    tok: tiktoken.Encoding, prompt: str, pieces: Sequence[str], cache: dict[str, list[int]] | None = None
) -> np.ndarray:
    """The model's window of one context. Each piece is tokenised on its own, so ``cache`` (text to ids)
    lets a dataset builder tokenise every piece once across all the steps that contain it."""
    texts = [clip_prompt(prompt), *clip_pieces(pieces)]
    if cache is None:
        ids = tok.encode_ordinary_batch(texts, num_threads=1)
    else:
        missing = [t for t in texts if t not in cache]
        for t, i in zip(missing, tok.encode_ordinary_batch(missing, num_threads=1), strict=True):
            cache[t] = i
        ids = [cache[t] for t in texts]
    return window(ids[0], ids[1:])


class Windowed(Protocol):
    """A context ready for the model: a training example or a served query."""

    @property
    def ids(self) -> np.ndarray: ...

    @property
    def features(self) -> np.ndarray: ...


def inputs(
    items: Sequence[Windowed], pad_id: int, multiple: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The model's three inputs for a batch: (input_ids, attention_mask, features)."""
    ids, mask = batch([x.ids for x in items], pad_id, multiple)
    return ids, mask, np.stack([x.features for x in items])


def batch(windows: Sequence[np.ndarray], pad_id: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad to a common length, a multiple of the model's pooling width: (input_ids, attention_mask).
    Left padding keeps every sequence's newest token in the last position."""
    longest = max((len(w) for w in windows), default=0)
    length = max(multiple, -(-longest // multiple) * multiple)
    ids = np.full((len(windows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(windows), length), dtype=np.int64)
    for i, w in enumerate(windows):
        if len(w):
            ids[i, length - len(w) :] = w
            mask[i, length - len(w) :] = 1
    return ids, mask

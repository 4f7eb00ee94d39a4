"""(context after step k, remaining completion tokens) examples from recorded trajectories (Heddle §4.1).

Step k is when Heddle predicts: k = 0 at admission, from the prompt alone; k >= 1 right after the k-th model
call, while its tool runs, so the context holds the k-th action but not its observation. Splits are by task:
every trajectory of a prompt lands in the same split, so no test prompt was ever seen in training.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from loom.data.traces import Trace, prompt_of
from loom.predict import context
from loom.text.tokenizer import qwen_tokenizer

Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")
# Fractions of tasks in train and val; the rest is test.
TRAIN_FRACTION = 0.7
VAL_FRACTION = 0.1


@dataclass(frozen=True)
class Example:
    task_id: str
    traj_id: str
    step: int
    ids: np.ndarray
    features: np.ndarray
    generated: int
    total: int

    @property
    def remaining(self) -> int:
        return self.total - self.generated


def split_of(task_id: str, seed: int = 0) -> Split:
    u = zlib.crc32(f"{seed}:{task_id}".encode()) / 2**32
    if u < TRAIN_FRACTION:
        return "train"
    return "val" if u < TRAIN_FRACTION + VAL_FRACTION else "test"


def prediction_points(
    task: str,
    actions: Sequence[str],
    observations: Sequence[str],
    calls: Sequence[tuple[int, int]],
    steps: Iterable[int] | None = None,
    cache: dict[str, list[int]] | None = None,
) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """``(k, generated, window, features)`` at each prediction point k (all of them by default) of a
    trajectory whose calls were ``calls`` (``(input_len, output_len)`` each): what the service is sent after
    k calls."""
    tok = qwen_tokenizer()
    wanted = set(range(len(calls)) if steps is None else steps)
    out = []
    generated = 0
    for k, (_, output_len) in enumerate(calls):
        if k in wanted:
            # What the service is told: the prompt's length at admission, later the last call's prompt and
            # output; the observation on its way back is not counted yet.
            ctx_len = sum(calls[k - 1]) if k else calls[0][0]
            ids = context.encode(tok, task, context.step_pieces(actions, observations, k), cache)
            out.append((k, generated, ids, context.features(k, generated, ctx_len)))
        generated += output_len
    return out


def trajectory_examples(
    trace: Trace, steps: Iterable[int] | None = None, cache: dict[str, list[int]] | None = None
) -> list[Example]:
    """One example per prediction point of ``trace`` (all of them by default), while tokens remain."""
    points = prediction_points(
        trace.task,
        [s.action for s in trace.steps],
        [s.observation for s in trace.steps],
        [(s.prompt_tokens, s.completion_tokens) for s in trace.steps],
        steps,
        cache,
    )
    total = trace.total_completion_tokens
    return [Example(prompt_of(trace), trace.id, k, ids, f, gen, total) for k, gen, ids, f in points]


def build(
    traces: Sequence[Trace], steps: Iterable[int] | None = None, seed: int = 0
) -> dict[Split, list[Example]]:
    steps = None if steps is None else list(steps)
    cache: dict[str, list[int]] = {}
    out: dict[Split, list[Example]] = {s: [] for s in SPLITS}
    for t in traces:
        out[split_of(prompt_of(t), seed)].extend(trajectory_examples(t, steps, cache))
        cache.clear()  # pieces never repeat across trajectories
    return out

"""The rollout-trace schema: one trajectory per line of JSON, what any team's rollout logs hold of a run, so
that Loom's harness can replay it (``loom.workloads.recorded``).

A line (``SCHEMA`` names the schema and its version; every other field is below):

    {"schema": "loom.rollout-trace/1", "group": "q17", "sample": 3, "step": 12, "reward": 1.0,
     "prompt": "...", "task": "search", "system_tokens": 1269,
     "turns": [{"context_tokens": 412, "output_tokens": 96, "cached_tokens": 380, "finish_reason": "stop",
                "env_s": 1.3, "tool_s": [0.9, 0.4], "action": "...", "observation": "..."}, ...]}

- ``group``: the prompt (GRPO's group): the samples of one prompt at one step share it; the same group at a
  later step is the same prompt again (its earlier samples are its history).
- ``sample``: its index in the group; ``step``: the training step (or epoch) that ran it.
- per turn, one model call: ``context_tokens`` its whole input, ``output_tokens`` what it generated,
  ``cached_tokens`` the part of the input served from a prefix cache where known, ``finish_reason`` the
  engine's, ``env_s`` the seconds in the environment after it (tool calls, a simulated user, scoring after the
  last), ``tool_s`` each tool call's seconds where known (``env_s`` is their sum where it is not given).
- ``system_tokens``, where known: how many tokens of its first input every trajectory of its task set starts
  with (the system prompt, tools, template); engines keep one copy of them in their prefix cache.
- optional text: ``prompt`` (the prompt's text), per turn ``action`` (the model's output) and ``observation``
  (what the environment returned): the learned predictor reads them.

A line that does not hold to it is an error naming the file, the line and the field, and nothing of the file
is returned (a replay of part of a log would measure another workload).
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, TextIO

import msgspec
from msgspec import Meta

SCHEMA = "loom.rollout-trace/1"

NonNeg = Annotated[int, Meta(ge=0)]
NonNegF = Annotated[float, Meta(ge=0.0)]


class Turn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    context_tokens: NonNeg
    output_tokens: NonNeg
    cached_tokens: NonNeg | None = None
    finish_reason: str | None = None
    env_s: NonNegF | None = None
    tool_s: list[NonNegF] | None = None
    action: str | None = None
    observation: str | None = None

    @property
    def env_seconds(self) -> float | None:
        """Seconds in the environment after the call: ``env_s``, else the sum of ``tool_s``, else unknown."""
        if self.env_s is not None:
            return self.env_s
        return sum(self.tool_s) if self.tool_s is not None else None


class Trajectory(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    schema: str
    group: Annotated[str, Meta(min_length=1)]
    sample: NonNeg
    turns: Annotated[list[Turn], Meta(min_length=1)]
    step: NonNeg = 0
    id: str | None = None
    reward: float | None = None
    prompt: str | None = None
    task: str | None = None
    system_tokens: NonNeg | None = None

    @property
    def key(self) -> str:
        """Its id, else what names it uniquely in a well-formed file: step, group and sample."""
        return self.id or f"{self.step}/{self.group}/{self.sample}"

    @property
    def has_text(self) -> bool:
        return self.prompt is not None and all(t.action is not None for t in self.turns)


class TraceFormatError(ValueError):
    """A line of a rollout-trace file that does not hold to the schema: its file, line and field."""


_DECODER = msgspec.json.Decoder(Trajectory)
_ENCODER = msgspec.json.Encoder()


def parse_line(line: str | bytes, where: str = "<line>") -> Trajectory:
    """One line as a trajectory, or a ``TraceFormatError`` naming ``where`` and the field at fault."""
    try:
        t = _DECODER.decode(line)
    except msgspec.ValidationError as e:
        # msgspec names the field as a path ("at `$.turns[2].output_tokens`").
        raise TraceFormatError(f"{where}: {e}") from None
    except msgspec.DecodeError as e:
        raise TraceFormatError(f"{where}: not JSON: {e}") from None
    if t.schema != SCHEMA:
        raise TraceFormatError(f"{where}: schema {t.schema!r}, this Loom reads {SCHEMA!r} - at `$.schema`")
    if t.system_tokens is not None and t.system_tokens > t.turns[0].context_tokens:
        raise TraceFormatError(
            f"{where}: system_tokens {t.system_tokens} exceed the first turn's context_tokens "
            f"{t.turns[0].context_tokens} - at `$.system_tokens`"
        )
    for i, turn in enumerate(t.turns):
        if turn.cached_tokens is not None and turn.cached_tokens > turn.context_tokens:
            raise TraceFormatError(
                f"{where}: cached_tokens {turn.cached_tokens} exceed context_tokens {turn.context_tokens}"
                f" - at `$.turns[{i}].cached_tokens`"
            )
    return t


def _open(path: Path) -> TextIO:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read(path: str | Path) -> list[Trajectory]:
    """Every trajectory of a rollout-trace file (``.gz`` read as gzip), in file order; blank lines skipped.
    Each id (``Trajectory.key``) is one trajectory: a repeat is an error naming both lines."""
    p = Path(path)
    out: list[Trajectory] = []
    seen: dict[str, int] = {}
    with _open(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            t = parse_line(line, f"{p}:{n}")
            if t.key in seen:
                raise TraceFormatError(
                    f"{p}:{n}: trajectory {t.key!r} again (first at line {seen[t.key]}) - at `$.id`"
                )
            seen[t.key] = n
            out.append(t)
    if not out:
        raise TraceFormatError(f"{p}: no trajectories")
    return out


def dumps(t: Trajectory) -> bytes:
    return _ENCODER.encode(t)


def write(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write ``trajectories`` one per line (gzip where the name ends ``.gz``); how many were written."""
    p = Path(path)
    n = 0
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "wb") as f:
        for t in trajectories:
            f.write(dumps(t) + b"\n")
            n += 1
    return n


def by_step(trajectories: Iterable[Trajectory]) -> Iterator[tuple[int, list[Trajectory]]]:
    """The trajectories of each training step, steps in order, each step's in file order."""
    steps: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        steps.setdefault(t.step, []).append(t)
    for s in sorted(steps):
        yield s, steps[s]

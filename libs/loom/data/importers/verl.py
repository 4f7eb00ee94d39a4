"""verl's rollout dump in the rollout-trace schema.

verl (``trainer.rollout_data_dir``; ``RayPPOTrainer._log_rollout_data`` and ``_write_generations``): a file
``{global_step}.jsonl`` per training step, a line per sample: ``input`` (the prompt, decoded with special
tokens skipped), ``output`` (the response, likewise: for a multi-turn agent loop every turn and tool response
in one text), ``gts``, ``score``, ``step`` and any reward-extra fields of the batch's length. What it holds
and what it does not:

- a group is the samples of one step whose ``input`` is the same text (verl keeps ``uid`` but does not dump
  it), samples in file order; the same text at a later step is the same prompt again (its history);
- token counts are the text's under Qwen's tokenizer (the dump holds text only; the chat template's special
  tokens are gone from it);
- one turn per sample: the dump does not say where a multi-turn response's turns and tool calls were, nor
  how long the environment took (replayed as 0 s; ``turns_without_env_s`` counts them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from loom.data import rollout_trace as rt
from loom.data.importers.turns import group_name
from loom.text.tokenizer import count_tokens


def _verl_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [p for p in path.glob("*.jsonl") if p.stem.isdigit()]
    if not files:
        raise rt.TraceFormatError(f"{path}: no verl dump ({{step}}.jsonl) in it")
    return sorted(files, key=lambda p: int(p.stem))


def from_verl(path: str | Path) -> Iterator[rt.Trajectory]:
    """The trajectories of a verl rollout dump (its directory, or one step's file), steps in order."""
    for f in _verl_files(Path(path)):
        yield from _verl_step(f)


def _verl_step(f: Path) -> Iterable[rt.Trajectory]:
    samples: dict[str, int] = {}
    with open(f, encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{f}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise rt.TraceFormatError(f"{where}: not JSON: {e}") from None
            for key, kind in (("input", str), ("output", str), ("step", int)):
                if not isinstance(row.get(key), kind):
                    raise rt.TraceFormatError(
                        f"{where}: a verl dump's `{key}` must be {kind.__name__}, got {row.get(key)!r} - at `$.{key}`"
                    )
            prompt, output = row["input"], row["output"]
            group = group_name(prompt)
            sample = samples.get(group, 0)
            samples[group] = sample + 1
            score = row.get("score")
            yield rt.Trajectory(
                rt.SCHEMA,
                group,
                sample,
                [rt.Turn(count_tokens(prompt), count_tokens(output), action=output)],
                step=row["step"],
                reward=float(score) if isinstance(score, int | float) else None,
                prompt=prompt,
                task=row.get("data_source") if isinstance(row.get("data_source"), str) else None,
            )

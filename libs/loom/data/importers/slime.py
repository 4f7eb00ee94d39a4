"""slime's rollout dump in the rollout-trace schema.

slime (``--save-debug-rollout-data PATH``, a template with ``{rollout_id}``; ``save_debug_rollout_data`` in
``slime/observability/rollout_data_utils.py``) writes one ``torch.save`` file per rollout:
``{"rollout_id": N, "samples": [Sample.to_dict(), ...]}``, and for an evaluation the same under
``eval_{N}`` in the name (not training rollouts: skipped in a directory). What a sample holds and what it
does not:

- its group is ``group_index`` (its prompt's samples); named by the prompt's text, so the same prompt at a
  later rollout is the same group (its history), and by ``group_index`` too where one rollout holds the text
  twice; samples in file order;
- ``tokens`` is the prompt and the response, the response being its last ``response_length``; a multi-turn
  rollout writes every call's output and every tool's reply into it, ``loss_mask`` telling them apart
  (``Sample.append_response_tokens``): each run of generated tokens is a turn (``turns.mask_turns``);
- ``status`` gives the last call's finish reason (completed: stop, truncated: length, aborted: abort); the
  calls before it ended in a tool call (stop);
- ``non_generation_time`` is the seconds outside generation, one figure per sample (0, slime's default, read
  as unknown): shared equally among its tool calls, or after its last call where it made none;
- ``prefix_cache_info`` sums the prefix cache over every call, so no turn's ``cached_tokens`` is known;
- text: ``prompt`` (a chat's messages joined) and, for a one-call sample, ``response`` as its action.

The file is read by torch's weights-only loader, so a dump runs no code when read; one that holds other
objects is an error naming the file.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loom.data import rollout_trace as rt
from loom.data.importers.turns import group_name, mask_turns
from loom.text.chat import joined_text

FINISH = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "error"}
_EVAL = re.compile(r"eval_\d+")


def from_slime(path: str | Path) -> Iterator[rt.Trajectory]:
    """The trajectories of slime's rollout dumps (a directory of ``*.pt``, or one file), rollouts in order."""
    p = Path(path)
    if p.is_file():
        files = [p]
    else:
        files = sorted(f for f in p.glob("*.pt") if not _EVAL.search(f.stem))
        if not files:
            raise rt.TraceFormatError(f"{p}: no slime rollout dump (--save-debug-rollout-data, *.pt) in it")
    dumps = sorted((_load(f) for f in files), key=lambda d: d[0])
    for (a, fa, _), (b, fb, _) in itertools.pairwise(dumps):
        if a == b:
            raise rt.TraceFormatError(f"{fb}: rollout {b} again (first in {fa}) - at `$.rollout_id`")
    for step, f, samples in dumps:
        yield from _rollout(f, step, samples)


def _load(f: Path) -> tuple[int, Path, list[Any]]:
    import torch  # slime's dumps are torch.save files; the rest of Loom's data path does without torch

    try:
        data = torch.load(f, weights_only=True, map_location="cpu")
    except Exception as e:  # any unreadable file is one error to the user
        raise rt.TraceFormatError(
            f"{f}: not a slime rollout dump torch can read without running code: {e}"
        ) from None
    if not isinstance(data, dict):
        raise rt.TraceFormatError(f"{f}: a slime dump is a dict, got {type(data).__name__} - at `$`")
    step, samples = data.get("rollout_id"), data.get("samples")
    if not isinstance(step, int) or step < 0:
        raise rt.TraceFormatError(f"{f}: `rollout_id` must be an int >= 0, got {step!r} - at `$.rollout_id`")
    if not isinstance(samples, list):
        raise rt.TraceFormatError(
            f"{f}: `samples` must be a list, got {type(samples).__name__} - at `$.samples`"
        )
    return step, f, samples


def _field(s: Any, key: str, kinds: tuple[type, ...], f: Path, i: int) -> Any:
    value = s.get(key) if isinstance(s, dict) else None
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise rt.TraceFormatError(
            f"{f}: sample {i}: a slime sample's `{key}` must be {' or '.join(k.__name__ for k in kinds)},"
            f" got {value!r} - at `$.samples[{i}].{key}`"
        )
    return value


def _ints(value: Any) -> list[int]:
    """A list of ints from a list or a tensor (slime keeps some token fields as tensors)."""
    return [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]


def _rollout(f: Path, step: int, samples: list[Any]) -> Iterator[rt.Trajectory]:
    names: dict[Any, str] = {}
    taken: set[str] = set()
    sizes: dict[str, int] = {}
    for i, s in enumerate(samples):
        status = _field(s, "status", (str,), f, i)  # first: a sample that is not a dict fails here
        where = f"{f}: sample {i}"
        raw = s.get("tokens")  # a list, or a tensor: only its length is read
        tokens = len(raw if hasattr(raw, "tolist") else _field(s, "tokens", (list,), f, i))
        response = _field(s, "response_length", (int,), f, i)
        if not 0 <= response <= tokens:
            raise rt.TraceFormatError(
                f"{where}: response_length {response} outside its {tokens} tokens"
                f" - at `$.samples[{i}].response_length`"
            )
        mask = s.get("loss_mask")
        mask = [1] * response if mask is None else _ints(mask)
        if len(mask) != response:
            raise rt.TraceFormatError(
                f"{where}: loss_mask has {len(mask)} entries for a response of {response}"
                f" - at `$.samples[{i}].loss_mask`"
            )
        prompt = _text(s.get("prompt"))
        index = s.get("group_index")
        if index not in names:
            name = group_name(prompt)
            names[index] = name if name not in taken else f"{name}-{index}"
            taken.add(names[index])
        group = names[index]
        sample = sizes.get(group, 0)
        sizes[group] = sample + 1
        yield rt.Trajectory(
            rt.SCHEMA,
            group,
            sample,
            _turns(tokens - response, mask, status, s),
            step=step,
            reward=float(s["reward"]) if isinstance(s.get("reward"), int | float) else None,
            prompt=prompt or None,
        )


def _text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return joined_text(prompt)
    return ""


def _turns(prompt_tokens: int, mask: Sequence[int], status: str, s: dict[str, Any]) -> list[rt.Turn]:
    calls = mask_turns(prompt_tokens, mask)
    env = s.get("non_generation_time")
    env = float(env) if isinstance(env, int | float) and env > 0 else None
    tools = sum(followed for *_, followed in calls)
    response = s.get("response") if len(calls) == 1 and isinstance(s.get("response"), str) else None
    turns = []
    for k, (context, output, followed) in enumerate(calls):
        last = k == len(calls) - 1
        share = None
        if env is not None:
            share = env / tools if followed else (env if tools == 0 and last else 0.0)
        turns.append(
            rt.Turn(
                context,
                output,
                finish_reason=FINISH.get(status) if last else "stop",
                env_s=share,
                action=response,
            )
        )
    return turns

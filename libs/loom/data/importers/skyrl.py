"""SkyRL's rollout dump in the rollout-trace schema.

SkyRL (``trainer.dump_data_batch=true``; ``RayPPOTrainer.dump_data`` in ``skyrl/train/trainer.py``) pickles
each step's training batch to ``{export_path}/dumped_data/global_step_{N}_training_input.pkl``: a
``TrainingInputBatch`` whose tensors are stored as numpy bytes (``TensorBatch.__getstate__``). What it holds
and what it does not:

- ``sequences`` / ``attention_mask``: each row its prompt and response, left-padded into one block;
  ``response_mask`` marks the response, right-aligned; ``loss_mask`` (right-aligned like it) marks what the
  model generated, 0 on what an environment returned: each run of generated tokens is a turn
  (``turns.mask_turns``);
- groups: ``metadata["policy_prompt_boundaries"]``, each prompt's rows (SkyRL drops the uids before it
  dumps), named by the prompt's token ids, so the same prompt at a later step is the same group again;
- ``metadata["pad_size"]``: rows copied in at the end to fill the data-parallel shards, not rollouts (dropped);
- not held: rewards (popped before the dump), finish reasons, text, and any time (environment seconds are
  unknown: replayed as 0 s, ``turns_without_env_s`` counts them). A step-wise run
  (``generator.step_wise_trajectories``) dumps a row per turn without saying which rows make a trajectory
  (``is_last_step`` is dropped too): each row is read as a trajectory of its own.

The pickle is read by an unpickler that knows only SkyRL's batch classes and ``torch.device``, rebuilding
them as plain data: SkyRL need not be installed, and a dump runs no code when read.
"""

from __future__ import annotations

import io
import itertools
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loom.data import rollout_trace as rt
from loom.data.importers.turns import group_name, mask_turns

_NAME = re.compile(r"global_step_(\d+)_training_input\.pkl")
_BATCH = "skyrl.backends.skyrl_train.training_batch"


def from_skyrl(path: str | Path) -> Iterator[rt.Trajectory]:
    """The trajectories of SkyRL's dumped training batches (``dumped_data``, its export path, or one file),
    steps in order."""
    p = Path(path)
    if p.is_dir() and (p / "dumped_data").is_dir():
        p = p / "dumped_data"
    files = [p] if p.is_file() else list(p.glob("global_step_*_training_input.pkl"))
    steps = []
    for f in files:
        m = _NAME.fullmatch(f.name)
        if m is None:
            raise rt.TraceFormatError(f"{f}: a SkyRL dump is named global_step_{{N}}_training_input.pkl")
        steps.append((int(m.group(1)), f))
    if not steps:
        raise rt.TraceFormatError(
            f"{p}: no SkyRL dump (dumped_data/global_step_{{N}}_training_input.pkl) in it"
        )
    for step, f in sorted(steps):
        yield from _step(f, step, _load(f))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _BATCH and name == "_rebuild_tensor_batch":
            return lambda _cls, state: state
        if module == _BATCH and name in ("TrainingInputBatch", "TensorBatch"):
            return name
        if module == "torch" and name == "device":
            return str
        raise pickle.UnpicklingError(f"a SkyRL dump holds only its batch classes, not {module}.{name}")


def _load(f: Path) -> dict[str, Any]:
    try:
        with open(f, "rb") as fh:
            state = _Unpickler(fh).load()
    except Exception as e:  # any unreadable file is one error to the user
        raise rt.TraceFormatError(f"{f}: not a SkyRL training batch: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("batch_dict"), dict):
        raise rt.TraceFormatError(f"{f}: not a SkyRL training batch (no batch_dict) - at `$.batch_dict`")
    return state


def _tensor(f: Path, state: dict[str, Any], key: str) -> np.ndarray:
    value = state["batch_dict"].get(key)
    if not isinstance(value, dict) or "data" not in value:
        raise rt.TraceFormatError(f"{f}: the batch has no `{key}` - at `$.batch_dict.{key}`")
    if value.get("format") == "torch":  # SkyRL's fallback for dtypes numpy lacks (bfloat16)
        import torch

        return torch.load(io.BytesIO(value["data"]), weights_only=True).float().numpy()
    return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])


def _step(f: Path, step: int, state: dict[str, Any]) -> Iterator[rt.Trajectory]:
    seqs, attn = _tensor(f, state, "sequences"), _tensor(f, state, "attention_mask")
    resp, loss = _tensor(f, state, "response_mask"), _tensor(f, state, "loss_mask")
    meta = state.get("metadata") or {}
    rows = len(seqs) - int(meta.get("pad_size") or 0)
    bounds = meta.get("policy_prompt_boundaries")
    if bounds is None:
        bounds = [(r, r + 1) for r in range(rows)]
    if (
        not bounds
        or bounds[0][0] != 0
        or bounds[-1][1] != rows
        or any(a[1] != b[0] for a, b in itertools.pairwise(bounds))
    ):
        raise rt.TraceFormatError(
            f"{f}: prompt boundaries {bounds} do not cover the batch's {rows} rollouts"
            " - at `$.metadata.policy_prompt_boundaries`"
        )
    for start, end in bounds:
        for sample, r in enumerate(range(start, end)):
            n_resp = int(resp[r].sum())
            real = seqs[r][attn[r].astype(bool)]
            prompt = len(real) - n_resp
            mask = loss[r][len(loss[r]) - n_resp :]
            group = group_name(real[:prompt].astype("<i8").tobytes())
            turns = [
                rt.Turn(c, o, finish_reason="stop" if followed else None)
                for c, o, followed in mask_turns(prompt, [int(m > 0) for m in mask])
            ]
            yield rt.Trajectory(rt.SCHEMA, group, sample, turns, step=step)

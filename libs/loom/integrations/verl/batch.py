"""Samples as the ``DataProto`` verl's trainer reads from its rollout (``AgentLoopWorker._postprocess``'s).

Laid out as verl lays out its own agent loops' outputs: prompts left-padded to ``rollout.prompt_length``,
responses right-padded to ``rollout.response_length``; ``input_ids`` the two side by side, ``attention_mask`` 1
on every real token, ``position_ids`` counting real tokens from 0; ``response_mask`` 1 on the model's tokens only
(0 on the environment's and on padding); ``rollout_log_probs`` the engine's; ``rm_scores`` Loom's reward at the
last response token, which verl's trainer takes as the reward (``extract_reward``) without scoring again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask

from loom.integrations.verl.samples import Sample

# Keys every verl agent loop's output carries, so that batches from different loops concatenate (verl's
# ``_postprocess`` keeps them whoever filled them).
STABLE_EXTRA_KEYS = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras")


def objects(values: Sequence[Any]) -> np.ndarray:
    """A 1-d object array of ``values`` (``np.array`` would make a list of lists 2-d)."""
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def extra_fields(s: Sample) -> dict[str, Any]:
    """What a sample adds to verl's non-tensor batch besides its tensors (verl's ``extra_fields``)."""
    return {
        "turn_scores": [],
        "tool_rewards": [],
        "min_global_steps": s.min_global_steps,
        "max_global_steps": s.max_global_steps,
        "extras": {},
        "loom_traj_id": s.traj_id,
        "loom_status": s.status,
        "loom_weight_version": s.weight_version,
    }


def to_dataproto(
    samples: Sequence[Sample],
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    non_tensor: Mapping[str, np.ndarray] | None = None,
    meta_info: Mapping[str, Any] | None = None,
) -> DataProto:
    """One row per sample, in order. ``non_tensor``: the input batch's own columns, handed back as verl's
    manager hands them back (its trainer unites them with the batch it kept)."""
    b, p, r = len(samples), prompt_length, response_length
    prompts = torch.full((b, p), pad_token_id, dtype=torch.int64)
    responses = torch.full((b, r), pad_token_id, dtype=torch.int64)
    prompt_attention = torch.zeros((b, p), dtype=torch.int64)
    response_attention = torch.zeros((b, r), dtype=torch.int64)
    response_mask = torch.zeros((b, r), dtype=torch.int64)
    logprobs = torch.zeros((b, r), dtype=torch.float32)
    scores = torch.zeros((b, r), dtype=torch.float32)
    for i, s in enumerate(samples):
        s = s.fit(p, r)
        n, m = len(s.prompt_ids), len(s.response_ids)
        prompts[i, p - n :] = torch.tensor(s.prompt_ids, dtype=torch.int64)
        prompt_attention[i, p - n :] = 1
        if m:
            responses[i, :m] = torch.tensor(s.response_ids, dtype=torch.int64)
            response_attention[i, :m] = 1
            response_mask[i, :m] = torch.tensor(s.response_mask, dtype=torch.int64)
            logprobs[i, :m] = torch.tensor(s.response_logprobs, dtype=torch.float32)
            scores[i, m - 1] = s.score
    attention = torch.cat([prompt_attention, response_attention], dim=1)
    batch = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": compute_position_id_with_mask(attention),
            "rollout_log_probs": logprobs,
            "rm_scores": scores,
        },
        batch_size=b,
    )
    columns: dict[str, np.ndarray] = {
        "__num_turns__": np.array([s.num_turns for s in samples], dtype=np.int32),
        # verl's trainer reads this column for every batch; a text-only sample has no multi-modal inputs.
        "multi_modal_inputs": objects([{} for _ in samples]),
        **dict(non_tensor or {}),
    }
    fields = [extra_fields(s) for s in samples]
    for key in fields[0] if fields else ():
        columns[key] = objects([f[key] for f in fields])
    return DataProto(
        batch=batch,
        non_tensor_batch=columns,
        meta_info={"reward_extra_keys": [], **dict(meta_info or {})},
    )

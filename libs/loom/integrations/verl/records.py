"""Samples as verl's v1 trainer reads them from TransferQueue (``AgentLoopWorkerTQ._agent_loop_postprocess``'s).

Under ``trainer.use_v1`` verl hands its rollout a ``TensorDict`` of distinct prompts (a ``uid`` each, not yet
repeated ``rollout.n`` times) and reads what came of them from TransferQueue: one record per sample under
``{uid}_{session}_0`` (the session is the sample's place in its prompt's group; a Loom trajectory is one output,
index 0), its fields 1-d and unpadded, its tag what verl's replay buffer balances and ages samples by. A prompt's
own key carries its status, which the replay buffer waits on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from loom.integrations.verl.batch import extra_fields
from loom.integrations.verl.samples import Sample

# Columns verl's worker consumes before a row reaches its agent loop: they are not stored with the samples.
CONSUMED = ("validate", "agent_name")


def prompt_rows(batch: TensorDict) -> list[dict[str, Any]]:
    """The batch's rows as verl's worker hands them to its agent loops: a tensor's row, a stack's item, a value
    every row shares (``global_steps``)."""
    rows: list[dict[str, Any]] = [{} for _ in range(len(batch))]
    for key, value in batch.items():
        if key in CONSUMED:
            continue
        for i, row in enumerate(rows):
            if isinstance(value, torch.Tensor):
                row[key] = value[i]
            elif isinstance(value, NonTensorStack):
                row[key] = value[i].data
            elif isinstance(value, NonTensorData):
                row[key] = value.data
            else:
                raise TypeError(f"verl's batch column {key!r} is a {type(value).__name__}")
    return rows


def record(
    s: Sample, row: Mapping[str, Any], session: int, seconds: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields and the tag of one sample (cut to verl's widths) of the prompt ``row``."""
    prompts = torch.tensor(s.prompt_ids, dtype=torch.int64)
    responses = torch.tensor(s.response_ids, dtype=torch.int64)
    mask = torch.tensor(s.response_mask, dtype=torch.int64)
    # Loom's reward at the last token: verl takes rm_scores as the reward and scores nothing again.
    scores = torch.zeros(len(s.response_ids), dtype=torch.float32)
    if len(scores):
        scores[-1] = s.score
    input_ids = torch.cat([prompts, responses])
    fields = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": mask,
        "rollout_log_probs": torch.tensor(s.response_logprobs, dtype=torch.float32),
        "rm_scores": scores,
        "num_turns": s.num_turns,
        "metrics": {"generate_sequences": seconds},
        "extra_fields": extra_fields(s),
        # The prompt's columns, as verl's worker stores every keyword its agent loop was called with.
        **row,
        "session_id": session,
        "loss_mask": mask,
        "input_ids": input_ids,
        # Every token is attended to: positions count from 0 (verl rebuilds the attention from the lengths).
        "position_ids": torch.arange(len(input_ids), dtype=torch.int64),
        "multi_modal_inputs": {},
    }
    tag = {
        "status": "success",
        "prompt_len": len(s.prompt_ids),
        "response_len": len(s.response_ids),
        "seq_len": len(input_ids),
        "global_steps": row["global_steps"],
        # The weights that made it, which verl's staleness control and metrics read.
        "min_global_steps": s.min_global_steps,
        "max_global_steps": s.max_global_steps,
    }
    return fields, tag

"""verl's rollout dump read into the rollout-trace schema: the files are written by verl's own
``RayPPOTrainer._log_rollout_data`` (``trainer.rollout_data_dir``) on a real ``DataProto``, two training steps
of GRPO groups, then imported and replayed by ``loom bench rollout --workload``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.data import importers
from loom.data import rollout_trace as rt
from loom.text.tokenizer import count_tokens, hf_tokenizer
from tests.trace_import import imports_and_replays

PROMPTS = ["What is 17 * 3? Think step by step.", "Name the capital of France and spell it backwards."]
GROUP = 3


def _dump(trainer: object, step: int, out: Path) -> list[tuple[str, str, float]]:
    """One step's batch through verl's dump code: every prompt GROUP times, responses of growing length."""
    from verl import DataProto

    tok = hf_tokenizer()
    rows, prompts, responses, scores = [], [], [], []
    for p in PROMPTS:
        for s in range(GROUP):
            text = " ".join(["step"] * (5 + 7 * s + step)) + f" answer {s}"
            rows.append((p, text, float(s % 2)))
    width_p = max(len(tok.encode(p)) for p, _, _ in rows)
    width_r = max(len(tok.encode(r)) for _, r, _ in rows)
    pad = tok.pad_token_id
    for p, r, score in rows:
        ids_p, ids_r = tok.encode(p), tok.encode(r)
        prompts.append([pad] * (width_p - len(ids_p)) + ids_p)  # verl left-pads prompts, right-pads responses
        responses.append(ids_r + [pad] * (width_r - len(ids_r)))
        level = torch.zeros(width_r)
        level[len(ids_r) - 1] = score
        scores.append(level)
    batch = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor(prompts),
            "responses": torch.tensor(responses),
            "token_level_scores": torch.stack(scores),
        },
        non_tensors={"reward_model": np.array([{"ground_truth": "51"} for _ in rows], dtype=object)},
    )
    trainer.global_steps = step  # type: ignore[attr-defined]
    trainer._log_rollout_data(batch, {}, {}, str(out))  # type: ignore[attr-defined]
    trainer._shutdown_dump_executor()  # type: ignore[attr-defined]
    trainer._init_dump_executor()  # type: ignore[attr-defined]
    return rows


def test_a_verl_rollout_dump_imports_and_replays(tmp_path: Path) -> None:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    # verl's trainer as far as its dump needs it: the tokenizer, the step and the dump's thread.
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.tokenizer = hf_tokenizer()
    trainer._init_dump_executor()
    dump = tmp_path / "rollout_data"
    written = {step: _dump(trainer, step, dump) for step in (1, 2)}
    assert sorted(p.name for p in dump.iterdir()) == ["1.jsonl", "2.jsonl"]

    trajectories = list(importers.from_verl(dump))
    assert [t.step for t in trajectories] == [1] * 6 + [2] * 6
    for t, (prompt, response, score) in zip(trajectories, written[1] + written[2], strict=True):
        assert t.prompt == prompt and t.turns[0].action == response and t.reward == score
        assert (t.turns[0].context_tokens, t.turns[0].output_tokens) == (
            count_tokens(prompt),
            count_tokens(response),
        )
    imports_and_replays("verl", dump, trajectories, tmp_path / "verl.jsonl")

    bad = dump / "3.jsonl"
    bad.write_text(json.dumps({"input": "x", "output": 5, "step": 3}) + "\n")
    with pytest.raises(rt.TraceFormatError, match=r"3.jsonl:1: a verl dump's `output` must be str, got 5"):
        list(importers.from_verl(dump))

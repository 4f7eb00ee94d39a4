"""A Loom trajectory as the row TRL's ``rollout_func`` contract reads (``loom.integrations.trl.rows_of``)."""

from __future__ import annotations

import pytest

from loom.protocol import Step, Trajectory
from loom.text.tokenizer import ENDOFTEXT

pytest.importorskip("trl", reason="the trl extra (make install installs it)")


def _traj(steps: list[Step], status: str = "completed", reward: float | None = 1.0) -> Trajectory:
    return Trajectory("j", "t", "q", 0, 0, "coin", status, "done", steps, 0.0, 0.0, reward)  # type: ignore[arg-type]


def _step(i: int, prompt: list[int], out: list[int], version: str = "3") -> Step:
    return Step(
        index=i,
        prompt_len=0,
        output_len=len(out),
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.5 - k for k in range(len(out))],
        weight_version=version,
    )


def test_a_multi_turn_trajectory_is_its_first_prompt_then_everything_after_it() -> None:
    from loom.integrations.trl import rows_of

    row = rows_of(_traj([_step(0, [1, 2, 3], [10, 11]), _step(1, [20, 21, 22], [30, ENDOFTEXT])]))
    assert row.prompt_ids == [1, 2, 3]
    assert row.completion_ids == [10, 11, 20, 21, 22, 30, ENDOFTEXT]
    assert row.env_mask == [1, 1, 0, 0, 0, 1, 1]  # the observation's tokens are the environment's
    assert row.logprobs == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.5, -1.5]
    assert (row.reward, row.weight_version, row.status) == (1.0, "3", "completed")


def test_a_failed_or_mixed_trajectory_keeps_its_row_and_says_so() -> None:
    from loom.integrations.trl import rows_of

    failed = rows_of(_traj([_step(0, [1, 2], [5])], status="failed", reward=None))
    assert failed.env_mask == [0] and failed.reward is None and failed.status == "failed"
    assert failed.prompt_ids == [1, 2]
    mixed = rows_of(_traj([_step(0, [1], [2], "1"), _step(1, [3], [4], "2")]))
    assert mixed.weight_version == "1,2"
    # An engine that never moved reports its start as "" (simulated) or "0" (transformers): both version 0.
    assert rows_of(_traj([_step(0, [1], [2], "")])).weight_version == "0"

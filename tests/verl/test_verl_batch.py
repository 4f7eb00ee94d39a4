"""Loom trajectories as verl's rollout output (``loom.integrations.verl``), checked against verl 0.9.1 itself: the
manager's ``DataProto`` is, tensor for tensor, what verl's own ``AgentLoopWorker`` makes of the same trajectories
returned by agent loops; and a batch's rows become one Loom job's groups as verl's GRPO groups them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from loom.protocol import Step, Trajectory
from loom.text.tokenizer import ENDOFTEXT
from tests.verl.conftest import PROMPT_LENGTH, QUIET, RESPONSE_LENGTH

pytestmark = QUIET


def _traj(
    steps: list[Step], status: str = "completed", reward: float | None = 1.0, traj_id: str = "t"
) -> Trajectory:
    return Trajectory("j", traj_id, "q", 0, 0, "coin", status, "done", steps, 0.0, 0.0, reward)  # type: ignore[arg-type]


def _step(i: int, prompt: list[int], out: list[int], version: str = "3") -> Step:
    return Step(
        index=i,
        prompt_len=len(prompt),
        output_len=len(out),
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[-0.5 - k for k in range(len(out))],
        weight_version=version,
    )


def test_a_multi_turn_trajectory_is_its_first_prompt_then_everything_after_it() -> None:
    from loom.integrations.verl import sample_of

    s = sample_of(_traj([_step(0, [1, 2, 3], [10, 11]), _step(1, [20, 21, 22], [30, ENDOFTEXT])]))
    assert s.prompt_ids == [1, 2, 3]
    assert s.response_ids == [10, 11, 20, 21, 22, 30, ENDOFTEXT]
    assert s.response_mask == [1, 1, 0, 0, 0, 1, 1]  # the observation's tokens are the environment's
    assert s.response_logprobs == [-0.5, -1.5, 0.0, 0.0, 0.0, -0.5, -1.5]
    assert (s.score, s.num_turns, s.status) == (1.0, 4, "completed")
    assert (s.weight_version, s.min_global_steps, s.max_global_steps) == ("3", 3, 3)


def test_what_cannot_be_trained_on_keeps_its_place_masked() -> None:
    from loom.integrations.verl import sample_of

    for t in (
        _traj([_step(0, [1, 2], [5])], status="failed", reward=None),
        _traj([_step(0, [1, 2], [5])], reward=None),  # completed, but the reward service gave no score
    ):
        s = sample_of(t)
        assert (s.prompt_ids, s.response_ids, s.response_mask, s.score) == ([1, 2], [ENDOFTEXT], [0], 0.0)
    mixed = sample_of(_traj([_step(0, [1], [2], "9"), _step(1, [3], [4], "10")]))
    assert (mixed.weight_version, mixed.min_global_steps, mixed.max_global_steps) == ("9,10", 9, 10)
    # An engine that never moved reports its start as "" (simulated) or "0" (transformers): step 0 alike.
    assert sample_of(_traj([_step(0, [1], [2], "")])).max_global_steps == 0


def test_the_batch_is_what_verls_own_agent_loop_worker_makes_of_the_same_samples(
    verl_config: Callable[..., Any],
) -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from loom.integrations.verl import sample_of, to_dataproto
    from loom.integrations.verl.agent_loop import agent_loop_output
    from loom.integrations.verl.batch import objects

    long_prompt = list(range(100, 100 + PROMPT_LENGTH + 7))
    long_turns = [_step(i, [7] * 5, list(range(200, 215))) for i in range(4)]  # past the response width
    samples = [
        sample_of(_traj([_step(0, [1, 2, 3], [10, 11]), _step(1, [20, 21], [30, ENDOFTEXT])], traj_id="a")),
        sample_of(_traj([_step(0, long_prompt, [12, ENDOFTEXT])], reward=0.25, traj_id="b")),
        sample_of(_traj([_step(0, [4, 5], [6])], status="failed", reward=None, traj_id="c")),
        sample_of(_traj([_step(0, [8], [9]), *long_turns[1:]], reward=-1.0, traj_id="d")),
    ]
    assert len(samples[3].response_ids) > RESPONSE_LENGTH
    raw = [[{"role": "user", "content": f"game {i}"}] for i in range(4)]
    columns = {"raw_prompt": objects(raw), "uid": objects(["u0", "u0", "u1", "u1"])}
    ours = to_dataproto(samples, PROMPT_LENGTH, RESPONSE_LENGTH, ENDOFTEXT, non_tensor=columns)

    worker = AgentLoopWorker(verl_config(), llm_client=None)

    async def verl_postprocess() -> Any:
        padded = [
            await worker._agent_loop_postprocess(
                agent_loop_output(s.fit(PROMPT_LENGTH, RESPONSE_LENGTH), 0.0), False, raw_prompt=raw[i]
            )
            for i, s in enumerate(samples)
        ]
        return worker._postprocess(padded, input_non_tensor_batch=columns)

    theirs = asyncio.run(verl_postprocess())
    keys = sorted(theirs.batch.keys())  # iterating a TensorDict walks its rows, not its keys
    assert sorted(ours.batch.keys()) == keys
    for key in keys:
        torch.testing.assert_close(ours.batch[key], theirs.batch[key], rtol=0, atol=0, msg=key)
    assert set(theirs.non_tensor_batch) <= set(ours.non_tensor_batch)
    for key, value in theirs.non_tensor_batch.items():
        assert list(ours.non_tensor_batch[key]) == list(value), key
    assert ours.meta_info["reward_extra_keys"] == theirs.meta_info["reward_extra_keys"] == []
    # Loom's reward sits at each response's last token; the environment's tokens are not the model's.
    assert ours.batch["rm_scores"].sum(1).tolist() == [1.0, 0.25, 0.0, -1.0]
    assert ours.batch["response_mask"][0, :7].tolist() == [1, 1, 0, 0, 1, 1, 0]
    assert int(ours.batch["response_mask"][2].sum()) == 0
    assert list(ours.non_tensor_batch["loom_traj_id"]) == ["j/a", "j/b", "j/c", "j/d"]


def test_rows_become_one_job_of_groups_as_verls_grpo_groups_them() -> None:
    from loom.integrations.verl.batch import objects
    from loom.integrations.verl.jobs import plan

    # verl gives each prompt a uid, then repeats it rollout.n times in a row.
    uid = objects(["x", "x", "x", "y", "y", "y"])
    tasks = objects(["coin/3"] * 3 + ["coin/9"] * 3)
    p = plan({"uid": uid, "loom_task": tasks}, 6, "coin")
    assert p.tasks == [{"id": "coin/3", "data": {"set": "coin"}}, {"id": "coin/9", "data": {"set": "coin"}}]
    assert p.group_size == 3
    assert p.slots == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    # Without a task column, a row's chat messages are its task, handed to the environment.
    msgs = objects([np.array([{"role": "user", "content": c}], dtype=object) for c in "aabb"])
    p = plan({"raw_prompt": msgs, "index": np.arange(4)}, 4, None)
    assert [t["id"] for t in p.tasks] == ["p0", "p1"] and p.group_size == 2
    assert p.tasks[1]["data"] == {"messages": [{"role": "user", "content": "b"}]}
    # A validation batch verl padded with its first rows again: groups of unequal size, one row each.
    p = plan({"uid": objects(["x", "y", "x"]), "loom_task": objects(["a", "b", "a"])}, 3, "coin")
    assert p.group_size == 1 and p.slots == [(0, 0), (1, 0), (2, 0)] and len(p.tasks) == 3


def test_the_manager_says_what_it_needs(
    verl_config: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom.integrations.verl import LoomAgentLoopManager

    with pytest.raises(ValueError, match=r"loom section with url and env"):
        LoomAgentLoopManager(verl_config())
    loom = ["+loom.url=http://127.0.0.1:9", "+loom.env=coin"]
    saves = ["actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]", "trainer.save_freq=1"]
    manager = LoomAgentLoopManager(verl_config(*loom, *saves))
    # verl's async v1 trainers keep their own replicas generating across steps; a Loom job ends with its batch.
    for mode in ("colocate_async", "separate_async"):
        with pytest.raises(
            ValueError, match=r"trainer_mode .*async is not served; set trainer.v1.trainer_mode=sync"
        ):
            LoomAgentLoopManager(verl_config(*loom, *saves, f"trainer.v1.trainer_mode={mode}"))
    LoomAgentLoopManager(
        verl_config(*loom, *saves, "trainer.v1.trainer_mode=colocate_async", "trainer.use_v1=false")
    )
    monkeypatch.delenv("LOOM_API_TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"LOOM_API_TOKEN"):
        manager.loom.api_token()

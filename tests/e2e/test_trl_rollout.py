"""TRL's own ``GRPOTrainer`` (the real package) with Loom as its rollout: ``rollout_func=LoomRollout(...)``
against `loom up`, two training steps of a tiny Qwen3 on the multi-turn coin game.

The simulated engines answer token-id requests with placeholder ids and log-probabilities, so what is checked
here is the contract: TRL's rows in TRL's order, environment tokens masked, Loom's reward as a column and a
reward function, and the trainer's weights pushed to the fleet when its step moves."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from loom import checkpoints as policy
from loom.envs import coin, transcript
from tests.e2e.conftest import LoomUp, start_loom_up

trl = pytest.importorskip("trl", reason="the trl extra (make install installs it)")
datasets = pytest.importorskip("datasets")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}


@pytest.fixture(scope="module")
def loom_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomUp]:
    yield from start_loom_up(tmp_path_factory.mktemp("loom"))


def test_trl_grpo_trainer_trains_on_loom_rollouts(loom_up: LoomUp, tmp_path: Path) -> None:
    from loom.integrations.trl import LoomGRPOTrainer, LoomRollout, loom_reward
    from loom.text.tokenizer import hf_tokenizer

    token = (loom_up.home / "api_token").read_text().strip()
    rollout = LoomRollout(
        loom_up.api,
        token,
        env="coin",
        dataset="coin",
        model="qwen3-8b",
        checkpoints=tmp_path / "ckpt",
        max_turns=4,
        max_tokens=32,
        max_turn_tokens=8,
    )
    seen: list[dict[str, Any]] = []

    def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = rollout(prompts, trainer)
        seen.append({"prompts": list(prompts), "version": rollout.version, **out})
        return out

    ids = list(coin.coin_tasks("train"))[:8]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=4,
        max_steps=2,
        max_completion_length=64,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = LoomGRPOTrainer(
            model=policy.build_tiny(seed=0, **SMALL),
            reward_funcs=loom_reward,
            args=args,
            processing_class=hf_tokenizer(),
            train_dataset=datasets.Dataset.from_list([{"prompt": i} for i in ids]),
            rollout_func=recording,
        )
        trainer.train()
    assert len(seen) == 2 and [s["version"] for s in seen] == [0, 1]
    for s in seen:
        # TRL's rows, in TRL's order: each prompt num_generations times, one Loom group per distinct prompt.
        assert len(s["prompt_ids"]) == len(s["prompts"]) == 8
        rows = zip(
            s["prompts"], s["prompt_ids"], s["completion_ids"], s["logprobs"], s["env_mask"], strict=True
        )
        for task_id, p, c, lp, m in rows:
            assert p == transcript.encode(coin.prompt(coin.coin_tasks("train")[task_id]))
            assert len(c) == len(lp) == len(m) and m[0] == 1
        assert all(isinstance(r, float) for r in s["loom_reward"])
        assert set(s["loom_weight_version"]) == {str(s["version"])}
    # The placeholder replies are not valid calls: the game answers, and its answer is masked out.
    assert any(0 in m for s in seen for m in s["env_mask"])
    assert not (tmp_path / "ckpt").exists()  # broadcast to the fleet: no checkpoint written
    assert rollout.stale_rows == 0
    # The fleet's weights are the admin's to move, forward only.
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    assert api.get("/v1/models/qwen3-8b/weights").json()["version"] == "1"
    again = api.post("/v1/models/qwen3-8b/weights", json={"version": 1, "path": str(tmp_path / "v1")})
    assert again.status_code == 409, again.text
    assert api.get("/v1/models/no-such-model/weights").status_code == 404
    assert trainer.state.global_step == 2


def test_the_trl_example_trains_in_two_processes_against_an_embedded_loom(tmp_path: Path) -> None:
    """examples/trl-grpo/train.py as a user runs it (small) under ``accelerate launch`` with two processes
    (gloo on CPUs; accelerate starts several CPU processes only through its multi-process launcher): Loom
    serves the trainer's starting checkpoint on the transformers engine, each process runs its slice of the
    batch, and after each step the main process broadcasts the whole model to the fleet while the other
    waits. So every step's samples come from the weights the trainer scores them with."""
    example = Path(__file__).parents[2] / "examples" / "trl-grpo" / "train.py"
    small = ["--steps", "3", "--groups", "2", "--group-size", "4", "--warm-steps", "30"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += [
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]
    r = subprocess.run(
        [*launch, str(example), "--json", "--out", str(tmp_path), *small],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["processes"] == 2 and s["steps"] == 3 and s["rows"] == 2 * 3 * 8
    # Exactly one fleet version per step, the step's own: moved once, by the main process, before its rollouts.
    assert s["versions_per_step"] == [[0], [1], [2]]
    assert s["checkpoints_written"] == 0
    assert s["env_tokens_masked"] and s["stale_rows"] == 0
    assert s["logprob_max_abs_diff"] is not None and s["logprob_max_abs_diff"] <= 0.02

"""SkyRL 0.3.0's trainer writing its rollout dump (``trainer.dump_data_batch``), run as a script:
``python -m tests.skyrl.skyrl_dump OUT``. Two GRPO steps of two prompts, three samples each, go the way
``RayPPOTrainer.train`` takes a step's generator output to its dump: ``prepare_generator_input``,
``postprocess_generator_output``, ``convert_to_training_input`` (padded to the data-parallel size),
``compute_advantages_and_returns``, the pops, ``dump_data``. The generator's output is built as SkyRL's
multi-turn generator lays it out: per sample the prompt's ids, then each call's output (loss mask 1) and each
tool's reply (loss mask 0), ending with EOS. Prints, as JSON, what was written: per row its step, prompt
index and (context, output) per call, for the test to check the import against."""

from __future__ import annotations

import json
import sys
import types
import typing

import typing_extensions

# SkyRL is written for Python 3.12: on 3.11 pydantic refuses the typing.TypedDict its Tinker types use.
typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

from skyrl.train.config.config import SkyRLTrainConfig  # noqa: E402
from skyrl.train.generators.utils import prepare_generator_input  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402

from loom.text import chat  # noqa: E402
from loom.text.tokenizer import hf_tokenizer  # noqa: E402

PROMPTS = ["What is 17 * 3? Use the calculator.", "Find the capital of France with the search tool."]
GROUP = 3
DP = 4  # the data-parallel size SkyRL pads each batch to: 6 rollouts become 8 rows


def _trainer(out: str) -> RayPPOTrainer:
    cfg = SkyRLTrainConfig()
    cfg.trainer.export_path = out
    cfg.trainer.dump_data_batch = True
    cfg.trainer.train_batch_size = cfg.trainer.policy_mini_batch_size = len(PROMPTS)
    cfg.generator.n_samples_per_prompt = GROUP
    # The trainer as far as a step's batch needs it: its config, tokenizer, metrics and the workers'
    # data-parallel size (the one part of the Ray cluster this path asks about).
    t = RayPPOTrainer.__new__(RayPPOTrainer)
    t.cfg, t.tokenizer, t.all_metrics = cfg, hf_tokenizer(), {}
    t.dispatch = types.SimpleNamespace(get_lcm_dp_size=lambda: DP)
    return t


def _step(t: RayPPOTrainer, step: int) -> list[dict[str, object]]:
    rows = [
        {"prompt": [{"role": "user", "content": q}], "env_class": None, "env_extras": {}, "uid": f"q{i}"}
        for i, q in enumerate(PROMPTS)
    ]
    gen_in, uids = prepare_generator_input(rows, GROUP, {}, "calculator", "train", step)
    prompts, responses, masks, rewards, written = [], [], [], [], []
    for k, messages in enumerate(gen_in["prompts"]):
        ids = chat.encode(chat.render(messages))
        response, mask, calls = [], [], []
        for call in range(1 + (k + step) % 3):  # one to three calls, varying over samples and steps
            if call:
                reply = chat.encode("<tool_response>" + " ok" * (4 + call + k) + "</tool_response>")
                response += reply
                mask += [0] * len(reply)
            out = chat.encode(
                "<think>" + " step" * (3 + 2 * k + call + step) + "</think><tool_call>{}</tool_call>"
            )
            calls.append((len(ids) + len(response), len(out)))
            response += out
            mask += [1] * len(out)
        response.append(t.tokenizer.eos_token_id)
        mask.append(1)
        calls[-1] = (calls[-1][0], calls[-1][1] + 1)
        prompts.append(ids)
        responses.append(response)
        masks.append(mask)
        rewards.append(float(k % 2))
        written.append({"step": step, "prompt": k // GROUP, "calls": calls})
    out = {
        "prompt_token_ids": prompts,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": masks,
        "stop_reasons": ["stop"] * len(prompts),
        "rollout_metrics": None,
        "rollout_logprobs": None,
        "trajectory_ids": gen_in["trajectory_ids"],
    }
    out, uids = t.postprocess_generator_output(out, uids)
    batch = t.convert_to_training_input(out, uids)
    batch["values"] = None  # no critic (GRPO)
    batch = t.compute_advantages_and_returns(batch)
    batch.pop("rewards")
    batch.metadata.pop("uids")
    batch.metadata.pop("is_last_step", None)
    t.global_step = step
    t.dump_data(batch, file_name=f"global_step_{t.global_step}_training_input")
    return written


if __name__ == "__main__":
    trainer = _trainer(sys.argv[1])
    print(json.dumps([row for step in (1, 2) for row in _step(trainer, step)]))

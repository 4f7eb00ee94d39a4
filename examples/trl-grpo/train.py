"""TRL's GRPOTrainer, unchanged but for ``rollout_func``: Loom runs the multi-turn rollouts.

    python examples/trl-grpo/train.py --json                      # an embedded Loom, started and stopped here
    python examples/trl-grpo/train.py --loom-url http://HOST:8080  # a Loom you run: loom up --engine hf ...

A small Qwen3 (built from a config and warm-started on coin demonstrations, as ``loom train`` does; or
``--model-path`` a local checkpoint) learns the ``coin`` game: open boxes with a tool, guided by a clue. Loom
serves the trainer's starting checkpoint on its transformers engine; after every step TRL's model is pushed to
Loom's fleet. Ends with one JSON line: steps, the weight versions Loom's workers served, rows trained, whether
environment tokens were masked, how far Loom's sampling log-probabilities were from the trainer's at the same
weights, and the batch reward at the first and last steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from trl import GRPOConfig

from loom import checkpoints as policy
from loom.envs import coin
from loom.integrations.trl import LoomGRPOTrainer, LoomRollout, loom_reward
from loom.text.tokenizer import hf_tokenizer
from loom.trainer.coin_warmstart import coin_warm_start

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}


def starting_checkpoint(out: Path, warm_steps: int) -> Path:
    model = policy.build_tiny(seed=0, **SMALL)
    coin_warm_start(model, list(coin.coin_tasks("train").values()), steps=warm_steps, follow=0.5, slip=0.15)
    return policy.save(model, out / "v0")


def train(url: str, token: str, start: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    rollout = LoomRollout(
        url, token, env="coin", dataset="coin", model=args.model, checkpoints=out / "ckpt",
        max_turns=4, max_tokens=32, max_turn_tokens=8,
    )  # fmt: skip
    seen: list[dict[str, Any]] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        rows = rollout(prompts, trainer)
        seen.append(rows)
        return rows

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=args.groups * args.group_size,
        num_generations=args.group_size,
        max_steps=args.steps,
        max_completion_length=64,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
    )
    tasks = Dataset.from_list([{"prompt": i} for i in coin.coin_tasks("train")]).shuffle(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = LoomGRPOTrainer(
            model=policy.load(start),
            reward_funcs=loom_reward,
            args=config,
            processing_class=hf_tokenizer(),
            train_dataset=tasks,
            rollout_func=rollout_func,
        )
        trainer.train()
    rollout.close()
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    rewards = [statistics.fmean(r for r in rows["loom_reward"] if r is not None) for rows in seen]
    return {
        "steps": trainer.state.global_step,
        "weight_versions": sorted({int(v) for rows in seen for v in rows["loom_weight_version"]}),
        "rows": sum(len(rows["completion_ids"]) for rows in seen),
        "env_tokens_masked": any(0 in m for rows in seen for m in rows["env_mask"]),
        # The first step's samples came from the weights the trainer started with: Loom's engine and the
        # trainer score them alike.
        "logprob_max_abs_diff": round(logs[0]["sampling/sampling_logp_difference/max"], 5) if logs else None,
        "stale_rows": rollout.stale_rows,
        "reward_first": round(statistics.fmean(rewards[:3]), 4),
        "reward_last": round(statistics.fmean(rewards[-3:]), 4),
    }


async def embedded(start: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train against a Loom started here, serving the starting checkpoint on its transformers engine."""
    from loom_cli.deploy import DeployConfig, Deployment, free_port

    dep = Deployment(
        DeployConfig(
            home=out / "loom",
            workers=1,
            api_port=free_port(),
            model=args.model,
            engine="hf",
            model_path=str(start),
            log_level="WARNING",
            extra_env={"LOOM_ROLLOUT_THREADS": "1", "LOOM_ROLLOUT_MAX_RUNNING": "64"},
        )
    )
    await dep.start(wait_s=180)
    try:
        return await asyncio.to_thread(train, dep.api_url, dep.api_token, start, args, out)
    finally:
        await dep.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--loom-url", help="a running Loom (its admin token in LOOM_API_TOKEN); none: start one here"
    )
    p.add_argument("--model", default="qwen3-tiny", help="the fleet's model name")
    p.add_argument("--model-path", help="the checkpoint the trainer and Loom's fleet start from")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warm-steps", type=int, default=1000)
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp(prefix="trl-grpo-"))
    start = Path(args.model_path) if args.model_path else starting_checkpoint(out, args.warm_steps)
    if args.loom_url:
        report = train(args.loom_url, os.environ["LOOM_API_TOKEN"], start, args, out)
    else:
        report = asyncio.run(embedded(start, args, out))
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)


if __name__ == "__main__":
    main()

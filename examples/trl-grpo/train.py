"""TRL's GRPOTrainer, unchanged but for ``rollout_func``: Loom runs the multi-turn rollouts.

    python examples/trl-grpo/train.py --json                      # an embedded Loom, started and stopped here
    python examples/trl-grpo/train.py --loom-url http://HOST:8080  # a Loom you run: loom up --engine hf ...
    accelerate launch --num_processes 2 --cpu examples/trl-grpo/train.py --json   # two training processes

A small Qwen3 (built from a config and warm-started on coin demonstrations, as ``loom train`` does; or
``--model-path`` a local checkpoint) learns the ``coin`` game: open boxes with a tool, guided by a clue. Loom
serves the trainer's starting checkpoint on its transformers engine; after every step TRL's model moves to
Loom's fleet in memory (``--weights collective``, broadcast from the main process; ``disk``: a checkpoint).
Under several processes each runs its slice of the batch as a Loom job, and the main process starts the
embedded Loom and moves the fleet. Ends with one JSON line: steps, the weight versions Loom's workers served
at each step, rows trained, whether environment tokens were masked, how far Loom's sampling log-probabilities
were from the trainer's at the same weights (the largest over every step), and the batch reward at the first
and last steps.
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
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object
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
    """This process's training; its own report (the main process's also holds what the run logged)."""
    rollout = LoomRollout(
        url, token, env="coin", dataset="coin", model=args.model, checkpoints=out / "ckpt",
        max_turns=4, max_tokens=32, max_turn_tokens=8, weights=args.weights,
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
    logs = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history
            if "sampling/sampling_logp_difference/max" in h]  # fmt: skip
    return {
        "steps": trainer.state.global_step,
        "versions": [sorted({int(v) for v in rows["loom_weight_version"]}) for rows in seen],
        "rows": sum(len(rows["completion_ids"]) for rows in seen),
        "env_tokens_masked": any(0 in m for rows in seen for m in rows["env_mask"]),
        "logprob_diffs": logs,
        "stale_rows": rollout.stale_rows,
        "rewards": [statistics.fmean(r for r in rows["loom_reward"] if r is not None) for rows in seen],
    }


def report(mine: list[dict[str, Any]], processes: int, out: Path) -> dict[str, Any]:
    """The run's report from every process's own (the main process's first)."""
    steps = mine[0]["steps"]
    per_step = [sorted({v for r in mine for v in r["versions"][i]}) for i in range(len(mine[0]["versions"]))]
    rewards = [statistics.fmean(r["rewards"][i] for r in mine) for i in range(len(mine[0]["rewards"]))]
    diffs = mine[0]["logprob_diffs"]  # TRL gathers every process's rows into the main process's log
    return {
        "processes": processes,
        "steps": steps,
        "weight_versions": sorted({v for vs in per_step for v in vs}),
        "versions_per_step": per_step,
        "rows": sum(r["rows"] for r in mine),
        "env_tokens_masked": any(r["env_tokens_masked"] for r in mine),
        # Every step's samples came from the weights the trainer held when it scored them: Loom's engine and
        # the trainer score them alike, step after step, once each update arrived whole.
        "logprob_max_abs_diff": round(max(diffs), 5) if diffs else None,
        "stale_rows": sum(r["stale_rows"] for r in mine),
        "checkpoints_written": len(list((out / "ckpt").glob("v*"))),
        "reward_first": round(statistics.fmean(rewards[:3]), 4),
        "reward_last": round(statistics.fmean(rewards[-3:]), 4),
    }


async def embedded(start: Path, args: argparse.Namespace, out: Path, share: Any) -> dict[str, Any]:
    """Train against a Loom started here, serving the starting checkpoint on its transformers engine; ``share``
    hands its address to the other processes."""
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
    try:
        await dep.start(wait_s=180)
    except BaseException:
        share(None, None)  # the others stop too
        raise
    try:
        share(dep.api_url, dep.api_token)
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
    p.add_argument("--weights", choices=("collective", "disk"), default="collective",
                   help="how the fleet gets each step's weights")  # fmt: skip
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=4, help="groups per process and step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warm-steps", type=int, default=1000)
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    # One process, or each of those `accelerate launch` started (gloo on CPUs); TRL's trainer joins this state.
    state = PartialState(cpu=True)
    main_process = state.is_main_process

    def shared(*values: Any) -> list[Any]:
        """The main process's values, on every process (a plain return with one process)."""
        return (
            broadcast_object_list(list(values), from_process=0) if state.num_processes > 1 else list(values)
        )

    out = Path(shared(args.out or tempfile.mkdtemp(prefix="trl-grpo-"))[0])
    start = None
    if main_process:
        start = Path(args.model_path) if args.model_path else starting_checkpoint(out, args.warm_steps)
    start = Path(shared(str(start))[0])
    if args.loom_url:
        mine = train(args.loom_url, os.environ["LOOM_API_TOKEN"], start, args, out)
    elif main_process:
        mine = asyncio.run(embedded(start, args, out, shared))
    else:
        url, token = shared(None, None)
        if url is None:
            raise SystemExit("the main process could not start Loom")
        mine = train(url, token, start, args, out)
    everyone = gather_object([mine]) if state.num_processes > 1 else [mine]
    # The process group goes before the interpreter does: gloo's threads, left to its exit, abort the process
    # ("terminate called without an active exception") once in a while.
    state.destroy_process_group()
    if main_process:
        r = report(everyone, state.num_processes, out)
        print(json.dumps(r) if args.json else json.dumps(r, indent=2), flush=True)


if __name__ == "__main__":
    main()

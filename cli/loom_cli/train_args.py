"""``loom train``'s arguments, apart from the trainer so that other commands need not import torch."""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="GRPO on a small real policy through Loom (CPU), async vs sync")
    t.add_argument("--quick", action="store_true", help="a smaller run (under 10 minutes)")
    t.add_argument("--tiny", action="store_true", help="the smallest run that exercises every part (tests)")
    t.add_argument("--json", action="store_true", help="end with one JSON line")
    t.add_argument("--task", choices=("coin", "arith"), help="what the policy learns (default coin)")
    t.add_argument("--steps", type=int)
    t.add_argument("--groups", type=int, help="groups per batch")
    t.add_argument("--group-size", type=int)
    t.add_argument("--async-bound", type=int)
    t.add_argument("--workers", type=int, help="rollout workers (transformers engine, one thread each)")
    t.add_argument("--warm-steps", type=int, help="supervised warm-start steps (0: none)")
    t.add_argument("--eval-tasks", type=int, help="held-out arith-eval tasks scored before and after")
    t.add_argument("--seed", type=int)
    t.add_argument("--lr", type=float, help="GRPO learning rate")
    t.add_argument("--base", help="a local Qwen3 checkpoint directory to start from instead of a tiny model")
    t.add_argument("--no-sync", action="store_true", help="skip the async_bound=0 comparison run")
    t.add_argument(
        "--weights",
        choices=("collective", "store", "disk"),
        default="collective",
        help="how each update reaches the fleet (loom.weights): broadcast over gloo (default), the bus's "
        "object store, or a checkpoint per step on disk",
    )
    t.add_argument(
        "--control",
        choices=("shuffled",),
        help="a control run: 'shuffled' hands GRPO the batch's rewards in random order (no gain expected)",
    )
    t.add_argument(
        "--seeds", type=int, default=1, help="run the whole pipeline (warm start included) this many times"
    )
    t.add_argument("--out", default="bench-out/train", help="checkpoints, logs, plot and report")

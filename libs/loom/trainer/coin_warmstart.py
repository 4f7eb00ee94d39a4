"""A short supervised warm start of a fresh policy on the ``coin`` game, from play that ignores the clue.

A randomly initialised policy never writes a well-formed ``open`` call, so RL from scratch sees reward 0. The
warm start trains it on demonstrations built token for token as a live trajectory's context grows
(``loom.envs.transcript``): the prompt of ``CoinEnv.reset()``, each call's output ids with the stop token, then
the ids of the observation the environment answered, until the game ends. The demonstrations play legally but
blindly (distinct boxes in random order, drawn afresh for every sequence: ``coin.blind_play``), so they teach
the format and nothing about the clue: finding the coin from the clue is left to RL. The loss is on the model's
outputs only, as in RL. (Measured on the tiny policies: after 300 steps every format token has probability
above 0.99, while box numbers follow their overall frequency in the demonstrations, not yet the box count or
the boxes already opened.)

The optimiser, schedule and sampled softmax are those of ``loom.trainer.warmstart``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from loom.envs import actions
from loom.envs.coin import CoinEnv, CoinTask, blind_play, open_action, prompt
from loom.envs.transcript import encode, observation_ids
from loom.policy import STOP_IDS
from loom.trainer.grpo import Flat, collate, sequence_logprobs
from loom.trainer.warmstart import WarmStartConfig, _lr_at, sampled_nll


def play_sequence(task: CoinTask, boxes: Sequence[int], form: str = "react") -> Flat:
    """The context a live trajectory builds when the policy opens ``boxes`` in turn: the prompt's ids, then per
    call its output ids with the stop token (loss mask 1) and, unless the game ended, the observation's ids
    (loss mask 0). Calls after the game ended are left out."""
    env = CoinEnv(task)
    ids = encode(prompt(task))
    mask = [0.0] * len(ids)
    for box in boxes:
        action = open_action(box, form)
        out = [*encode(action), STOP_IDS[0]]
        ids += out
        mask += [1.0] * len(out)
        obs = env.act(actions.parse(action))
        if obs.done:
            break
        seen = observation_ids(obs.text)
        ids += seen
        mask += [0.0] * len(seen)
    return Flat(
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(mask, dtype=torch.float32),
        torch.zeros(len(ids), dtype=torch.float32),
    )


def blind_sequence(task: CoinTask, rng: random.Random, form: str = "react") -> Flat:
    """A demonstration that ignores the clue (``coin.blind_play``) as a warm-start sequence."""
    return play_sequence(task, blind_play(task, rng), form)


def coin_warm_start(
    model: nn.Module,
    tasks: Sequence[CoinTask],
    steps: int = 300,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    form: str = "react",
    cfg: WarmStartConfig | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train ``model`` for ``steps`` AdamW steps of ``batch`` clue-blind demonstrations on games drawn (seeded)
    from ``tasks``: the token-mean negative log-likelihood of the outputs, with ``loom.trainer.warmstart``'s
    schedule and sampled softmax (``cfg``; its steps, batch, lr and seed are the arguments here). Returns the
    final loss and timings; ``log`` (optional) gets each step's metrics."""
    cfg = cfg or WarmStartConfig()
    if not tasks:
        raise ValueError("a warm start needs tasks")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=True)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    t0 = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    for step in range(steps):
        picked = [tasks[rng.randrange(len(tasks))] for _ in range(batch)]
        b = collate([blind_sequence(t, rng, form) for t in picked], [0.0] * batch)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, cfg, lr)
        if cfg.negatives is None:
            loss = -sequence_logprobs(model, b, 1.0, cfg.head_chunk).mean()
        else:
            loss = sampled_nll(model, b, cfg.negatives, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += int(b.loss_mask.sum())
        if log is not None:
            log(
                {
                    "step": float(step),
                    "loss": losses[-1],
                    "grad_norm": float(norm),
                    "lr": _lr_at(step, steps, cfg, lr),
                }
            )
    model.eval()
    elapsed = time.perf_counter() - t0
    tail = losses[-max(1, min(20, len(losses))) :] if losses else [math.nan]
    return {
        "steps": float(steps),
        "loss": sum(tail) / len(tail),
        "first_loss": losses[0] if losses else math.nan,
        "seconds": elapsed,
        "seconds_per_step": elapsed / max(1, steps),
        "output_tokens": float(tokens),
    }

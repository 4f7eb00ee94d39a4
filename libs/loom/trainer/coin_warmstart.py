"""A short supervised warm start of a fresh policy on the ``coin`` game, from an imperfect demonstrator.

A randomly initialised policy never writes a well-formed ``open`` call, so RL from scratch sees reward 0. The
warm start trains it on demonstrations built token for token as a live trajectory's context grows
(``loom.envs.transcript``): the prompt of ``CoinEnv.reset()``, each call's output ids with the stop token, then
the ids of the observation the environment loop answered, until the game ends. The demonstrator is the kind
of data an SFT set holds, good and bad mixed (``demonstration``): it follows the clue in a share ``follow`` of
the games and plays legal, distinct boxes blind in the others, and it writes a share ``slip`` of its calls
carelessly (``coin.sloppy_action``, ``Open[three]``: the game ends with reward 0). The policy imitates all of
it; RL then has to tell the good from the bad. The loss is on the model's outputs only, as in RL. (Measured
with the small policy of ``loom train``, ``follow`` 0.5, ``slip`` 0.15, held-out games at temperature 1: after
300 steps, reward 0.21, half the games ended by a careless call, and 42% of first boxes allowed by the clue,
chance level: the clue not yet learned; after 1,000 steps, reward 0.33 and 59%. The demonstrator itself scores
0.54 and follows the clue in 72% of first boxes. The policy makes mistakes the demonstrator never makes: a box
beyond the last, 17-21% of games after 1,000 steps of 16 games, and a box opened twice, 13-18%; batches of 32
games, 0.41 and 74% with 17% and 15%: the default. How many games a careless call ends is left to the last
batches' draw at this constant learning rate: 76 to 130 of 400 between warm starts.)

The optimiser, schedule and sampled softmax are those of ``loom.trainer.warmstart``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from loom.envs import actions
from loom.envs.base import Observation
from loom.envs.coin import CoinEnv, CoinTask, blind_play, clue_play, open_action, prompt, sloppy_action
from loom.envs.transcript import encode, observation_ids
from loom.text.tokenizer import STOP_IDS
from loom.trainer.grpo import Batch, Flat, collate
from loom.trainer.warmstart import WarmStartConfig, fit


def play_sequence(task: CoinTask, calls: Sequence[str]) -> Flat:
    """The context a live trajectory builds when the policy writes ``calls`` in turn (``coin.open_action``
    texts, or anything else): the prompt's ids, then per call its output ids with the stop token (loss mask 1)
    and, unless the game ended, the ids of the observation the environment loop answers (loss mask 0; a call
    it cannot parse gets ``actions.invalid``). Calls after the game ended are left out."""
    env = CoinEnv(task)
    ids = encode(prompt(task))
    mask = [0.0] * len(ids)
    for action in calls:
        out = [*encode(action), STOP_IDS[0]]
        ids += out
        mask += [1.0] * len(out)
        try:
            obs = env.act(actions.parse(action))
        except actions.ParseError as e:
            obs = Observation(actions.invalid(e))
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


def demonstration(
    task: CoinTask, rng: random.Random, follow: float = 0.0, slip: float = 0.0, form: str = "react"
) -> list[str]:
    """One demonstration's calls: with probability ``follow`` the boxes the clue allows
    (``coin.clue_play``), otherwise distinct boxes blind (``coin.blind_play``); each call is written
    carelessly (``coin.sloppy_action``: a wasted turn) with probability ``slip``."""
    boxes = clue_play(task, rng) if rng.random() < follow else blind_play(task, rng)
    return [sloppy_action(b, form) if rng.random() < slip else open_action(b, form) for b in boxes]


def coin_warm_start(
    model: nn.Module,
    tasks: Sequence[CoinTask],
    steps: int = 300,
    batch: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    form: str = "react",
    follow: float = 0.0,
    slip: float = 0.0,
    cfg: WarmStartConfig | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train ``model`` for ``steps`` AdamW steps (``loom.trainer.warmstart.fit``) of ``batch`` demonstrations
    on games drawn (seeded) from ``tasks``: each follows the clue with probability ``follow``
    (``coin.clue_play``) and plays blind otherwise (``coin.blind_play``). ``cfg`` gives the schedule and
    sampled softmax; its steps, batch, lr and seed are the arguments here. Returns the final loss and
    timings; ``log`` (optional) gets each step's metrics."""
    if not tasks:
        raise ValueError("a warm start needs tasks")
    for name, p in (("follow", follow), ("slip", slip)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} is a probability, got {p}")
    rng = random.Random(seed)

    def draw(step: int) -> Batch:
        picked = [tasks[rng.randrange(len(tasks))] for _ in range(batch)]
        demos = [play_sequence(t, demonstration(t, rng, follow, slip, form)) for t in picked]
        return collate(demos, [0.0] * batch)

    return fit(model, draw, steps, lr, replace(cfg or WarmStartConfig(), seed=seed), log)

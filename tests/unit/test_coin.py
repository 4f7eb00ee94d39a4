"""The coin game: generated task sets, the environment's rules, and the warm start's sequences."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from typing import Any

import pytest
import torch

from loom.checkpoints import build_tiny
from loom.envs import actions, coin
from loom.envs.actions import ToolCall
from loom.envs.coin import CoinEnv, CoinTask, clue_play, coin_tasks, open_action, sloppy_action
from loom.text.tokenizer import STOP_IDS
from loom.trainer.coin_warmstart import coin_warm_start, demonstration, play_sequence
from loom.trainer.warmstart import WarmStartConfig
from tests.conftest import need_shared


def _play(task: CoinTask, texts: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Step a fresh game with these model outputs, as the live loop does (parse, then step): observations
    and the verdict."""

    async def game() -> tuple[list[str], dict[str, Any]]:
        env = CoinEnv(task)
        assert await env.reset() == coin.prompt(task)
        seen = []
        for text in texts:
            obs = await env.step(actions.parse(text))
            seen.append(obs.text)
            if obs.done:
                break
        await env.close()
        return seen, env.verdict()

    return asyncio.run(game())


def test_task_sets_are_deterministic_sized_and_disjoint() -> None:
    train, held = coin_tasks("train"), coin_tasks("eval")
    assert len(train) == coin.SIZES["train"] and len(held) == coin.SIZES["eval"]
    assert coin_tasks.__wrapped__("train") == train and coin_tasks.__wrapped__("eval") == held
    assert list(train)[:2] == ["coin/0", "coin/1"] and next(iter(held)) == "coin-eval/0"
    p_train = {coin.prompt(t) for t in train.values()}
    p_held = {coin.prompt(t) for t in held.values()}
    assert not p_train & p_held
    # No held-out game (box count and clue) is trained on under any opening sentence.
    game = lambda t: (t.boxes, t.kind, t.phrasing)  # noqa: E731
    assert not {game(t) for t in train.values()} & {game(t) for t in held.values()}
    # A held-out prefix repeats no prompt while it can: `loom train` scores 200 or 300 games.
    assert len({coin.prompt(t) for t in list(held.values())[:240]}) == 240
    assert len({t.opening for t in held.values()}) == len(coin.OPENINGS)
    # Every clue kind is in both sets, and the held-out set has several distinct prompts of each.
    for kind in coin.KINDS:
        assert any(t.kind == kind for t in train.values())
        assert len({coin.prompt(t) for t in held.values() if t.kind == kind}) >= 2
    with pytest.raises(KeyError):
        coin_tasks("test")


def test_every_clue_is_true_and_narrows_to_the_tries() -> None:
    for task in [*coin_tasks("train").values(), *coin_tasks("eval").values()]:
        allowed = task.candidates()
        assert task.coin in allowed and 1 <= task.coin <= task.boxes
        assert 2 <= len(allowed) <= task.tries == task.boxes // 2
        assert task.clue in coin.prompt(task) and task.clue in coin.PHRASINGS[task.kind]
        for b in range(1, task.boxes + 1):
            is_allowed = {
                "even": b % 2 == 0,
                "odd": b % 2 == 1,
                "prime": b in (2, 3, 5, 7),
                "square": b in (1, 4, 9),
                "three": b % 3 == 0,
            }[task.kind]
            assert (b in allowed) == is_allowed


def test_clue_following_play_wins_every_held_out_game() -> None:
    """Brute force: every order of the boxes the clue allows finds the coin within the tries."""
    games = 0
    for task in coin_tasks("eval").values():
        for order in itertools.permutations(task.candidates()):
            seen, verdict = _play(task, [coin.open_action(b) for b in order])
            assert verdict["score"] == 1.0 and verdict["reason"] == "found", (task, order, seen)
            assert seen[-1] == f"Box {task.coin} holds the coin!"
            games += 1
        assert coin.clue_play(task)[-1] == task.coin
    assert games > len(coin_tasks("eval"))


def test_reference_play_is_legal_and_ignores_the_clue() -> None:
    tasks = list(coin_tasks("train").values())
    won, expected = 0, 0.0
    for task in tasks:
        script = CoinEnv(task).reference_actions()
        assert script == CoinEnv(task).reference_actions()  # seeded by the task
        boxes = [coin.box_of(actions.parse(a).arguments) for a in script]
        assert len(set(boxes)) == len(boxes) <= task.tries
        assert all(b is not None and 1 <= b <= task.boxes for b in boxes)
        seen, verdict = _play(task, script)
        assert len(seen) == len(script)
        assert verdict["reason"] in ("found", "out of tries")
        assert verdict["opened"] == boxes
        won += int(verdict["score"])
        expected += task.tries / task.boxes
    # Blind play wins tries / boxes of games (0.47 here); following the clue would win all of them.
    assert abs(won - expected) < 3 * (expected * (1 - expected / len(tasks))) ** 0.5
    assert 0.40 < won / len(tasks) < 0.55


def test_both_action_forms_open_a_box() -> None:
    task = CoinTask("t", 8, 4, "even", 0, 6)
    forms = [
        '<tool_call>\n{"name": "open", "arguments": {"box": 3}}\n</tool_call>',
        '<tool_call>{"name": "open", "arguments": {"box": "3"}}</tool_call>',
        '{"name": "open", "arguments": {"box": 3}}',
        "Action: Open[3]",
        "Thought: box 3 first.\nAction: Open[3]",
        "Open[3]",
        "Open[box 3]",
        coin.open_action(3, "json"),
        coin.open_action(3, "react"),
    ]
    for text in forms:
        seen, verdict = _play(task, [text])
        assert seen == ["Box 3 is empty."], text
        assert verdict["opened"] == [3] and verdict["reason"] == "unfinished" and verdict["score"] == 0.0
    seen, verdict = _play(task, ["Open[2]", "Action: Open[6]"])
    assert seen == ["Box 2 is empty.", "Box 6 holds the coin!"]
    assert verdict["score"] == 1.0 and verdict["found"] is True


@pytest.mark.parametrize(
    ("call", "says", "reason"),
    [
        (ToolCall("search", {"input": "coin"}), "Unknown tool 'search'", "unknown tool"),
        (ToolCall("open", {}), "open needs a box number from 1 to 6, not None", "no box number"),
        (ToolCall("Open", {"input": "three"}), "not 'three'", "no box number"),
        (ToolCall("open", {"box": True}), "needs a box number", "no box number"),
        (ToolCall("open", {"box": 7}), "There is no box 7: the boxes are numbered 1 to 6", "no such box"),
        (ToolCall("Open", {"input": "0"}), "There is no box 0", "no such box"),
    ],
)
def test_an_invalid_call_ends_the_game_with_reward_0(call: ToolCall, says: str, reason: str) -> None:
    env = CoinEnv(CoinTask("t", 6, 3, "odd", 1, 5))
    asyncio.run(env.reset())
    assert not asyncio.run(env.step(ToolCall("open", {"box": 1}))).done
    obs = asyncio.run(env.step(call))
    assert obs.done and says in obs.text and "The game is over." in obs.text
    verdict = env.verdict()
    assert verdict["score"] == 0.0 and verdict["reason"] == reason and verdict["opened"] == [1]
    # The game stays over: the coin's box no longer scores.
    late = asyncio.run(env.step(ToolCall("open", {"box": 5})))
    assert late.done and env.verdict()["score"] == 0.0


def test_running_out_of_tries_ends_the_game_and_repeats_cost_a_try() -> None:
    task = CoinTask("t", 4, 2, "odd", 0, 3)
    seen, verdict = _play(task, ["Open[1]", "Open[1]", "Open[3]"])
    assert seen == ["Box 1 is empty.", "Box 1 is empty. No tries left: the game is over."]
    assert verdict["score"] == 0.0 and verdict["reason"] == "out of tries" and verdict["opened"] == [1, 1]
    env = CoinEnv(task)
    assert env.verdict()["reason"] == "unfinished" and env.verdict()["score"] == 0.0


def test_warm_start_sequences_are_the_live_transcript() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    from loom.envs.transcript import action_text, encode, observation_ids
    from loom.text.tokenizer import qwen_tokenizer

    task = CoinTask("t", 6, 3, "even", 0, 4)
    f = play_sequence(
        task, [coin.open_action(b) for b in (1, 4, 2)]
    )  # the game ends at box 4: box 2 is left out
    p = encode(coin.prompt(task))
    a1, a4 = [*encode("Open[1]"), STOP_IDS[0]], [*encode("Open[4]"), STOP_IDS[0]]
    o1 = observation_ids("Box 1 is empty.")
    assert f.ids.tolist() == p + a1 + o1 + a4
    assert f.loss_mask.tolist() == [0] * len(p) + [1] * len(a1) + [0] * len(o1) + [1] * len(a4)
    assert not f.behaviour_logprobs.any()
    text = qwen_tokenizer().decode([i for i in f.ids.tolist() if i not in STOP_IDS])
    assert text == coin.prompt(task) + "Open[1]\nObservation: Box 1 is empty.\nOpen[4]"
    assert action_text(a4) == "Open[4]"
    # The JSON form builds the same transcript around the tool call.
    j = play_sequence(task, [coin.open_action(4, "json")])
    assert j.ids.tolist() == [*p, *encode(coin.open_action(4, "json")), STOP_IDS[0]]
    # Blind demonstrations: distinct boxes, outputs scored, the last call ends the game.
    rng = random.Random(0)
    for _ in range(50):
        b = play_sequence(task, demonstration(task, rng))
        scored = b.ids[b.loss_mask.bool()].tolist()
        calls = qwen_tokenizer().decode([i for i in scored if i not in STOP_IDS])
        boxes = [int(c) for c in calls.replace("Open[", " ").replace("]", " ").split()]
        assert len(set(boxes)) == len(boxes) and (boxes[-1] == 4 or len(boxes) == 3)
        assert scored.count(STOP_IDS[0]) == len(boxes)


def test_demonstrations_follow_the_clue_and_slip_as_asked() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    from loom.envs.transcript import encode, observation_ids

    task = CoinTask("t", 8, 4, "square", 0, 4)  # the clue allows boxes 1 and 4
    rng = random.Random(1)
    for _ in range(30):
        calls = demonstration(task, rng, follow=1.0)
        assert set(calls) <= {"Open[1]", "Open[4]"} and calls[-1] == "Open[4]"
    slips = [c for _ in range(400) for c in demonstration(task, rng, slip=0.3)]
    share = sum(not c[5].isdigit() for c in slips) / len(slips)
    assert 0.25 < share < 0.35 and all(c.startswith("Open[") for c in slips)
    # A careless call names its box in words: the game ends there with reward 0, in either form.
    for form in ("react", "json"):
        env = CoinEnv(task)
        obs = env.act(actions.parse(coin.sloppy_action(4, form)))
        assert obs.done and env.verdict()["reason"] == "no box number" and env.verdict()["score"] == 0.0
    sloppy = play_sequence(task, ["Open[four]", "Open[4]"])
    assert sloppy.loss_mask.sum() == len(encode("Open[four]")) + 1
    # A call the loop cannot parse spends a turn, as in the live loop: the observation says so, the game goes on.
    f = play_sequence(task, ["open[4]", "Open[4]"])
    try:
        actions.parse("open[4]")
    except actions.ParseError as e:
        invalid = observation_ids(actions.invalid(e))
    ids = f.ids.tolist()
    assert invalid and any(ids[i : i + len(invalid)] == invalid for i in range(len(ids)))
    assert f.loss_mask.sum() == len(encode("open[4]")) + len(encode("Open[4]")) + 2


def test_coin_warm_start_fits_the_demonstrations() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    torch.manual_seed(0)
    model = build_tiny(0, num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=8)
    tasks = list(coin_tasks("train").values())[:200]
    logged: list[dict[str, float]] = []
    cfg = WarmStartConfig(warmup_steps=2)
    out = coin_warm_start(model, tasks, steps=16, batch=4, lr=1e-2, seed=0, cfg=cfg, log=logged.append)
    assert len(logged) == 16 and out["steps"] == 16.0
    assert logged[-1]["loss"] < 0.75 * out["first_loss"], [round(d["loss"], 2) for d in logged]
    assert not model.training
    with pytest.raises(ValueError):
        coin_warm_start(model, [], steps=1)


def test_baselines_are_what_their_plays_score() -> None:
    train = list(coin.coin_tasks("train").values())
    held = list(coin.coin_tasks("eval").values())
    rng = random.Random(0)
    for t in held[:50]:
        assert coin.random_value(t) == t.tries / t.boxes
        assert coin.play_value(t, [open_action(b) for b in clue_play(t, rng)]) == 1.0
        assert coin.play_value(t, [sloppy_action(t.coin), open_action(t.coin)]) == 0.0
        assert coin.clue_consistent(t, [*t.candidates(), 0]) == (len(t.candidates()), len(t.candidates()) + 1)
    # The best fixed order of each box count is at least as good, on the games it was chosen from, as the
    # average order, which is what opening distinct boxes at random scores.
    orders = coin.fixed_orders(train)
    fixed = statistics.fmean(coin.fixed_order_value(t, orders) for t in train)
    assert fixed >= statistics.fmean(coin.random_value(t) for t in train)
    for t in held[:50]:
        assert coin.fixed_order_value(t, orders) == coin.play_value(
            t, [open_action(b) for b in orders[t.boxes][: t.tries]]
        )

"""The example environments of examples/loom-guess, driven as the environment manager drives them."""

from __future__ import annotations

import asyncio
import json

from loom_guess import Guess

from loom.envs.api import Action, StepResult
from loom.text import chat
from services.envmgr.user_loop import EnvBroken, observation_messages


def _act(text: str) -> Action:
    reply = chat.parse_reply(text)
    return Action(text, reply.content, reply.tool_calls)


def _guess(n: int) -> Action:
    return _act(
        f"Trying.\n<tool_call>\n{json.dumps({'name': 'guess', 'arguments': {'number': n}})}\n</tool_call>"
    )


def test_a_binary_search_agent_wins_the_guessing_game() -> None:
    async def play() -> list[StepResult]:
        env = Guess()
        first = await env.reset({"secret": 71, "low": 1, "high": 100, "tries": 7})
        assert '<tools>\n{"type": "function", "function": {"name": "guess"' in chat.render(first, Guess.tools)
        low, high, results = 1, 100, []
        while True:
            mid = (low + high) // 2
            r = await env.step(_guess(mid))
            results.append(r)
            if r.done:
                return results
            low, high = (mid + 1, high) if "higher" in str(r.observation) else (low, mid - 1)

    results = asyncio.run(play())
    assert results[-1].reward == 1.0 and len(results) <= 7
    assert all(r.reward is None for r in results[:-1])


def test_observations_follow_a_reply_as_tool_results_or_a_user_turn() -> None:
    calls, plain = _guess(3), _act("no idea")
    assert observation_messages(StepResult("x"), calls) == [{"role": "tool", "content": "x"}]
    assert observation_messages(StepResult("x"), plain) == [{"role": "user", "content": "x"}]
    given = [{"role": "user", "content": "y"}]
    assert observation_messages(StepResult(given), calls) == given
    try:
        observation_messages("x", plain)
    except EnvBroken as e:
        assert "StepResult" in str(e)
    else:
        raise AssertionError("a step's wrong answer type must be refused")

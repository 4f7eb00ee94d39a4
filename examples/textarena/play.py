"""textarena's single-player games, played by textarena's own unmodified ``OpenAIAgent`` through Loom's gateway.

It submits an external job (or drives one given with --job) whose tasks name a game and a seed, then plays
every session at once, one thread each (the agent is synchronous): ``ta.make(game)``, ``reset``, and the
agent, pointed at the session's ``base_url`` with the session's key, answering each observation until the
game is done. The game's own outcome (``env.close()``'s reward of player 0) is the reward the session
finishes with. It prints one JSON line.

    python examples/textarena/play.py --api http://127.0.0.1:8080 --token "$(cat .loom/api_token)" --games 4

The default game, GuessTheNumber-v0, needs nothing beyond textarena itself (no word lists, no network); a
game that ends after a few invalid moves or ``max_turns`` guesses keeps a run against random replies short.
"""

from __future__ import annotations

import argparse
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import textarena as ta
from textarena.agents import OpenAIAgent

GAME = "GuessTheNumber-v0"
# textarena's reset seeds Python's global random and then draws the game from it: one reset at a time, so that
# each game is its seed's whatever the other threads do.
_RESET = threading.Lock()


def play(session: dict[str, Any], model: str, max_tokens: int) -> dict[str, Any]:
    """One session: one game, played to its end by the agent, finished with the game's reward."""
    data = session["task"]["data"]
    env = ta.make(data.get("game", GAME))
    with _RESET:
        env.reset(num_players=1, seed=data.get("seed"))
    # textarena's agent as it ships: where it sends its requests and their max_tokens are ours to give. Given a
    # key it needs no OPENAI_API_KEY; the session's key opens that session alone.
    agent = OpenAIAgent(
        model_name=model, base_url=session["base_url"], api_key=session["api_key"], max_tokens=max_tokens
    )
    done, turns = False, 0
    while not done:
        _, observation = env.get_observation()
        done, _ = env.step(agent(observation))
        turns += 1
    rewards, game_info = env.close()
    reward = float(rewards[0])
    # The OpenAI client under the session's base URL reaches `finish` there too.
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=2)
    client.post("/finish", body={"reward": reward}, cast_to=object)
    return {
        "traj_id": session["traj_id"],
        "turns": turns,
        "reward": reward,
        "reason": game_info[0].get("reason"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--api", required=True, help="Loom's API, e.g. http://127.0.0.1:8080")
    p.add_argument("--token", required=True, help="an API token of your tenant")
    p.add_argument("--job", help="drive this external job instead of submitting one")
    p.add_argument("--game", default=GAME, help="a single-player textarena game id")
    p.add_argument("--games", type=int, default=4, help="games (tasks), each with its own seed")
    p.add_argument("--group-size", type=int, default=2, help="sessions per game")
    p.add_argument("--max-tokens", type=int, default=16, help="the most tokens of one reply")
    p.add_argument("--model", default="policy", help="the model name the agent sends (Loom serves its own)")
    args = p.parse_args()
    api = openai.OpenAI(base_url=f"{args.api.rstrip('/')}/v1", api_key=args.token)
    job_id = args.job
    if job_id is None:
        tasks = [{"id": f"game{i}", "data": {"game": args.game, "seed": i}} for i in range(args.games)]
        spec = {
            "env": "external",
            "tasks": tasks,
            "group_size": args.group_size,
            "max_turn_tokens": args.max_tokens,
            "session_idle_s": 120,
        }
        job_id = api.post("/jobs", body=spec, cast_to=dict)["id"]
    sessions = api.get(f"/jobs/{job_id}/sessions", cast_to=dict)["sessions"]
    with ThreadPoolExecutor(max_workers=max(1, len(sessions))) as pool:
        runs = list(pool.map(lambda s: play(s, args.model, args.max_tokens), sessions))
    print(
        json.dumps(
            {
                "job": job_id,
                "sessions": len(runs),
                "turns": sum(r["turns"] for r in runs),
                "mean_reward": sum(r["reward"] for r in runs) / max(1, len(runs)),
                "games": runs,
            }
        )
    )


if __name__ == "__main__":
    main()

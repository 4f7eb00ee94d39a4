"""Environments and agents of other libraries, run unchanged through `loom up` (scheduler, router, simulated
engines, environment manager, reward): SkyRL-Gym's text environments on the user loop, and textarena's own
OpenAIAgent playing its games through the OpenAI-compatible gateway.

The simulated engines reply with random tokens, so a free-running policy earns what the library gives a
wrong or unformatted reply; a scripted one (the task's reference reply, teacher-forced through the engine)
shows that the library's reward reaches the trajectory."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.text import chat
from tests.e2e.conftest import LoomUp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).parents[2]


def _every_step_has_ids_and_logprobs(t: dict[str, Any]) -> None:
    assert t["steps"], t
    for s in t["steps"]:
        assert s["prompt_ids"] and s["output_ids"], s
        assert s["output_logprobs"] is not None and len(s["output_logprobs"]) == len(s["output_ids"]), s


# ---------------------------------------------------------------- SkyRL-Gym (loom.envs.adapters.skyrl_gym)


def test_skyrl_gym_gsm8k_multi_turn_runs_unchanged(loom_up: LoomUp, tmp_path: Path) -> None:
    """`skyrl_gym:gsm8k_multi_turn` on Loom's GSM8K tasks: every trajectory's steps carry the engine's ids and
    log-probs, and its reward is the sum of the library's turn rewards; scripted replies score above 0."""
    pytest.importorskip("skyrl_gym")
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    for env, words in [
        ("skyrl_gym:gsm8k_multiturn", "did you mean gsm8k_multi_turn"),
        ("skyrl_gym:text2sql", "which Loom does not ship"),
    ]:
        r = api.post("/v1/jobs", json={"env": env, "dataset": {"limit": 4}, "group_size": 2})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "env"], r.text
        assert words in r.text
    spec = {"env": "skyrl_gym:gsm8k_multi_turn", "dataset": {"limit": 4}, "group_size": 2}
    free = loom_up.submit(tmp_path, spec)
    scripted = loom_up.submit(tmp_path, {**spec, "scripted": True})
    # With no max_turn_tokens the simulated engine spends the whole token budget in one reply; short turns
    # play SkyRL's episode out: a wrong reply is asked again, up to the environment's max_turns.
    turns = loom_up.submit(
        tmp_path,
        {**spec, "dataset": {"limit": 2}, "env_params": {"max_turns": 3}, "max_turn_tokens": 16},
    )
    ids = {f"gsm8k-test/{i}" for i in range(4)}
    for job_id in (free, scripted):
        job = loom_up.wait_job(job_id, timeout=600)
        assert job["state"] == "completed" and job["completed"] == 8 and job["failed"] == 0, job
        trajs = loom_up.results(tmp_path, job_id)
        assert len(trajs) == 8 and {t["task_id"] for t in trajs} == ids
        for t in trajs:
            assert t["status"] == "completed" and t["env"] == "skyrl_gym:gsm8k_multi_turn", t
            _every_step_has_ids_and_logprobs(t)
            verdict = t["info"]["verdict"]
            assert len(verdict["rewards"]) == len(t["steps"]) <= 5
            assert t["reward"] == pytest.approx(sum(verdict["rewards"]))
            # The first prompt is Qwen3's template over SkyRL's first message: the question and its instruction.
            first = chat.decode(t["steps"][0]["prompt_ids"])
            assert first.startswith("<|im_start|>user\n") and 'tentative numeric answer after "####"' in first
            if job_id == scripted:
                # The worked solution, scored 1.0 by SkyRL's reward function, ends the episode at once.
                (step,) = t["steps"]
                assert t["reward"] > 0 and t["reward"] == 1.0 and t["finish_reason"] == "done", t["info"]
                assert "####" in step["action"]
    job = loom_up.wait_job(turns, timeout=300)
    assert job["state"] == "completed" and job["completed"] == 4 and job["failed"] == 0, job
    for t in loom_up.results(tmp_path, turns):
        _every_step_has_ids_and_logprobs(t)
        # Random replies earn no reward (nor the format's share), so SkyRL's episode runs to its max_turns.
        assert len(t["steps"]) == 3 and t["finish_reason"] == "done", t["info"]
        assert t["info"]["verdict"]["rewards"] == [0.0, 0.0, 0.0] and t["reward"] == 0.0
        # Each later prompt is only what follows the engine's reply: SkyRL's message as a user turn.
        asked = chat.decode(t["steps"][2]["prompt_ids"])
        assert "<|im_start|>user\nNow provide only the final numeric answer" in asked
        assert asked.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- textarena (examples/textarena/play.py)


def test_textarenas_openai_agent_plays_through_the_gateway(loom_up: LoomUp) -> None:
    """examples/textarena/play.py: textarena's unmodified OpenAIAgent plays GuessTheNumber in eight sessions
    to `finish`; every call is a step of the session's trajectory with the engine's ids and log-probs, and the
    game's outcome is the reward."""
    pytest.importorskip("textarena")
    token = (loom_up.home / "api_token").read_text().strip()
    script = ROOT / "examples" / "textarena" / "play.py"
    cmd = [sys.executable, str(script), "--api", loom_up.api, "--token", token, "--games", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["sessions"] == 8
    job = loom_up.wait_job(out["job"], timeout=120)
    assert job["state"] == "completed" and job["completed"] == 8 and job["failed"] == 0, job
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    trajs = {t["traj_id"]: t for t in api.get(f"/v1/jobs/{out['job']}/trajectories").json()["items"]}
    assert len(trajs) == 8
    for game in out["games"]:
        t = trajs[game["traj_id"]]
        assert t["status"] == "completed" and t["reward"] == pytest.approx(game["reward"]), t
        # One model call per move the agent made, each a fresh chat of textarena's system prompt and board.
        assert len(t["steps"]) == game["turns"]
        _every_step_has_ids_and_logprobs(t)
        assert all(len(s["output_ids"]) <= 16 for s in t["steps"])
        assert "Guess The Number" in chat.decode(t["steps"][0]["prompt_ids"])


# ---------------------------------------------------------------- GEM (loom.envs.adapters.gem, its own venv)

GEM_GUESS = "gem:game:GuessTheNumber-v0-easy"


def _need_gem() -> None:
    """GEM runs in .venv-gem (`make install` builds it), from which `loom up` starts a GEM-only manager."""
    from loom.envs.adapters import gem

    python = gem.default_python()
    if python is None or not Path(python).exists():
        pytest.skip("no GEM virtualenv (.venv-gem): `make install` builds it")


def _gem_trajectories(up: LoomUp, tmp_path: Path, job_id: str, n: int) -> list[dict[str, Any]]:
    job = up.wait_job(job_id, timeout=600)
    assert job["state"] == "completed" and job["completed"] == n and job["failed"] == 0, job
    trajs = up.results(tmp_path, job_id)
    assert len(trajs) == n
    for t in trajs:
        assert t["status"] == "completed" and t["finish_reason"] == "done", t
        _every_step_has_ids_and_logprobs(t)
        # The library's reward: GEM's reward for each step, summed.
        rewards = t["info"]["verdict"]["rewards"]
        assert len(rewards) == len(t["steps"]) and t["reward"] == pytest.approx(sum(rewards))
    return trajs


def test_gem_guess_the_number_runs_through_loom_up(loom_up: LoomUp, tmp_path: Path) -> None:
    """The issue's spec, as written, on `loom up --workers 2`: eight trajectories of GEM's GuessTheNumber, run
    by the GEM manager (the main one cannot import GEM), each with the engine's ids and log-probs and GEM's
    reward; an id GEM does not register is a 422 at submission."""
    _need_gem()
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    r = api.post("/v1/jobs", json={"env": "gem:game:GuessTheNumbr-v0-easy", "dataset": {"limit": 4}})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "env"], r.text
    assert "did you mean game:GuessTheNumber-v0-easy" in r.text
    spec = {"env": GEM_GUESS, "dataset": {"limit": 4}, "group_size": 2}
    trajs = _gem_trajectories(loom_up, tmp_path, loom_up.submit(tmp_path, spec), 8)
    assert {t["task_id"] for t in trajs} == {"0", "1", "2", "3"}
    firsts: dict[str, set[str]] = {}
    for t in trajs:
        assert t["env"] == GEM_GUESS and 1 <= len(t["steps"]) <= 4
        first = chat.decode(t["steps"][0]["prompt_ids"])
        assert (
            first.startswith("<|im_start|>user\nYou are playing Guess The Number.")
            and "between 1 and 10" in first
        )
        firsts.setdefault(t["task_id"], set()).add(first)
        # Random replies hold no \boxed{N}: GEM ends the game with its format-error reward.
        assert t["info"]["verdict"]["rewards"][-1] == -0.1
    # A task is a seed: a group's samples play one game.
    assert all(len(f) == 1 for f in firsts.values())


def test_gem_guess_the_number_scripted_by_binary_search_wins(loom_up: LoomUp, tmp_path: Path) -> None:
    """Scripted: each turn's reply is a binary search on GEM's higher/lower hints, teacher-forced through the
    engine; GEM's hints come back as user turns and every game is won (reward 1)."""
    _need_gem()
    spec = {"env": GEM_GUESS, "dataset": {"offset": 4, "limit": 4}, "group_size": 2, "scripted": True}
    spec["max_turn_tokens"] = 64  # the simulated engine times a forced reply by its token budget
    trajs = _gem_trajectories(loom_up, tmp_path, loom_up.submit(tmp_path, spec), 8)
    assert any(len(t["steps"]) > 1 for t in trajs)
    for t in trajs:
        assert t["reward"] == 1.0 and t["info"]["verdict"]["rewards"][-1] == 1.0, t["info"]
        assert all("\\boxed{" in s["action"] for s in t["steps"])
        for s in t["steps"][1:]:
            # What follows the reply: GEM's hint as a user turn, then the next generation prompt.
            hint = chat.decode(s["prompt_ids"])
            assert hint.startswith("\n<|im_start|>user\nAt turn") and "the target number is" in hint, hint


def test_gem_gsm8k_uses_gems_python_tool_in_a_docker_sandbox(
    sandbox_image: str, loom_up: LoomUp, tmp_path: Path
) -> None:
    """GEM's MathEnv on Loom's shipped GSM8K, wrapped in GEM's python_tool wrapper whose code runs in the
    trajectory's Docker sandbox: a scripted policy calls the tool (a tool turn comes back) and then answers;
    GEM grades it. A free-running one gets GEM's 0."""
    _need_gem()
    spec = {"env": "gem:math:GSM8K", "dataset": {"limit": 2}, "group_size": 2}
    scripted = loom_up.submit(tmp_path, {**spec, "scripted": True, "max_turn_tokens": 64})
    free = loom_up.submit(tmp_path, {**spec, "max_turn_tokens": 64, "max_turns": 3})
    for t in _gem_trajectories(loom_up, tmp_path, scripted, 4):
        assert t["info"]["sandbox"] == "docker"
        tool, answer = t["steps"]
        assert "<python>" in tool["action"] and "\\boxed{" in answer["action"]
        result = chat.decode(answer["prompt_ids"])
        assert result.startswith("\n<|im_start|>user\n<tool_response>\nCode execution result: "), result
        # GEM's python_tool wrapper: 0.05 + 0.25 for a tool call that ran, then 1 for the right answer.
        assert t["info"]["verdict"]["rewards"] == pytest.approx([0.3, 1.0]) and t["reward"] > 0
        first = chat.decode(t["steps"][0]["prompt_ids"])
        assert "Return your final answer within \\boxed{}." in first
    for t in _gem_trajectories(loom_up, tmp_path, free, 4):
        assert t["reward"] <= 0.0 or "<python>" in "".join(s["action"] for s in t["steps"])


# ---------------------------------------------------------------- verifiers (loom.envs.adapters.verifiers)

VF_ENV = "vf-calc"  # examples/vf-calc: a verifiers ToolEnv, installed and allowed as an operator would


def _vf_client(base_url: str, api_key: str) -> Any:
    import verifiers as vf
    from openai import AsyncOpenAI

    return vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))


def test_a_verifiers_environment_runs_unchanged_through_the_gateway(loom_up: LoomUp) -> None:
    """verifiers' own rollout code, with its own OpenAI client pointed at each session of an external job, as at
    a vLLM server: the token ids and log-probs verifiers records are those of Loom's trajectory, and the
    environment's rubric scores the reward the session finishes with."""
    vf = pytest.importorskip("verifiers")
    env = vf.load_environment(VF_ENV)
    rows = [dict(env.dataset[i]) for i in range(4)]
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth, timeout=60)
    tasks = [
        {"id": str(r["example_id"]), "data": {"prompt": r["prompt"], "answer": r["answer"]}} for r in rows
    ]
    spec = {"env": "external", "tasks": tasks, "group_size": 2, "max_turn_tokens": 24}
    job = api.post("/v1/jobs", json=spec)
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    sessions = api.get(f"/v1/jobs/{job_id}/sessions").json()["sessions"]

    async def play(s: dict[str, Any]) -> dict[str, Any]:
        data = s["task"]["data"]
        record = {"prompt": data["prompt"], "answer": data["answer"], "example_id": int(s["task"]["id"])}
        sampling = {"logprobs": True, "extra_body": {"return_token_ids": True}}
        state = await env.rollout(record, _vf_client(s["base_url"], s["api_key"]), "qwen3-8b", sampling)
        await env.rubric.score_rollout(state)
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {s['api_key']}"}) as http:
            done = await http.post(s["base_url"] + "/finish", json={"reward": state["reward"]})
        assert done.status_code == 200, done.text
        return {"traj_id": s["traj_id"], "state": state}

    async def play_all() -> list[dict[str, Any]]:
        return await asyncio.gather(*(play(s) for s in sessions))

    played = asyncio.run(play_all())
    assert loom_up.wait_job(job_id, timeout=120)["completed"] == 8
    trajs = {t["traj_id"]: t for t in api.get(f"/v1/jobs/{job_id}/trajectories").json()["items"]}
    for p in played:
        t, state = trajs[p["traj_id"]], p["state"]
        assert t["reward"] == pytest.approx(state["reward"])
        _every_step_has_ids_and_logprobs(t)
        # Random replies neither call a tool nor answer: the environment asks again until its 4 turns are spent.
        assert (
            len(state["trajectory"]) == len(t["steps"]) == 4
            and state["stop_condition"] == "max_turns_reached"
        )
        # verifiers recorded each call's tokens from Loom's replies: each prompt the whole context Loom had built
        # (the earlier replies' ids as generated, then the new messages'), the ids and log-probs Loom's steps hold.
        context: list[int] = []
        for vf_step, step in zip(state["trajectory"], t["steps"], strict=True):
            tokens = vf_step["tokens"]
            context += step["prompt_ids"]
            assert tokens["prompt_ids"] == context
            assert tokens["completion_ids"] == step["output_ids"]
            assert tokens["completion_logprobs"] == pytest.approx(step["output_logprobs"])
            context += step["output_ids"]
        assert '"name": "add"' in chat.decode(t["steps"][0]["prompt_ids"])  # the tools, in Qwen3's template


def test_a_verifiers_job_runs_the_environment_in_loom(loom_up: LoomUp, tmp_path: Path) -> None:
    """`"env": "verifiers:vf-calc"` on `loom up --workers 2`: Loom runs the environment's rollout itself, eight
    trajectories of four tasks, each with the engine's ids and log-probs and the rubric's reward; an unknown id
    and arguments the environment refuses are 422 at submission."""
    pytest.importorskip("verifiers")
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth, timeout=60)
    for env, params, loc, words in [
        (
            "verifiers:vf-missing",
            {},
            "env",
            "no verifiers environment 'vf-missing'",
        ),  # allowed, not installed
        (f"verifiers:{VF_ENV}", {"bogus": 1}, "env_params", "unexpected keyword argument 'bogus'"),
        ("verifiers:json", {}, "env", "not in the operator's allowlist"),
    ]:
        r = api.post("/v1/jobs", json={"env": env, "env_params": params, "dataset": {"limit": 2}})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", loc], r.text
        assert words in r.text, r.text
    spec = {"env": f"verifiers:{VF_ENV}", "dataset": {"limit": 4}, "group_size": 2, "max_turn_tokens": 24}
    job_id = loom_up.submit(tmp_path, spec)
    job = loom_up.wait_job(job_id, timeout=300)
    assert job["state"] == "completed" and job["completed"] == 8 and job["failed"] == 0, job
    trajs = loom_up.results(tmp_path, job_id)
    assert len(trajs) == 8 and {t["group"] for t in trajs} == {0, 1, 2, 3}
    for t in trajs:
        assert t["status"] == "completed", t
        _every_step_has_ids_and_logprobs(t)
        verdict = t["info"]["verdict"]
        assert t["reward"] == pytest.approx(verdict["score"]) and "right_answer" in verdict["metrics"], (
            verdict
        )
        # Asked again after every reply, the rollout spends its 4 turns: each a step of the trajectory.
        assert verdict["stop_condition"] == "max_turns_reached" and len(t["steps"]) == 4, verdict


def test_verifiers_training_client_gets_tokens_from_the_tokens_route(loom_up: LoomUp) -> None:
    """verifiers' training path renders the chat itself and asks vLLM's `/inference/v1/generate` for tokens
    (`renderers.client.generate`, with its Qwen3 renderer over Qwen's tokenizer): the session's trajectory
    records the ids it sent and the ids and log-probs it got back."""
    pytest.importorskip("verifiers")
    import openai
    from openai import AsyncOpenAI
    from renderers.client import generate
    from renderers.qwen3 import Qwen3Renderer

    from loom.text.tokenizer import hf_tokenizer

    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth, timeout=60)
    task = {"id": "t", "data": {"question": "What is 2 plus 3?"}}
    job = api.post("/v1/jobs", json={"env": "external", "tasks": [task], "group_size": 1})
    assert job.status_code == 201, job.text
    (s,) = api.get(f"/v1/jobs/{job.json()['id']}/sessions").json()["sessions"]
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]

    async def run() -> dict[str, Any]:
        client = AsyncOpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)

        async def call(sampling: dict[str, Any]) -> dict[str, Any]:
            renderer = Qwen3Renderer(hf_tokenizer())
            return await generate(
                client=client,
                renderer=renderer,
                messages=messages,
                model="qwen3-8b",
                sampling_params=sampling,
            )

        # A sampling field that would change the distribution recorded is refused by name.
        with pytest.raises(openai.BadRequestError, match="top_k"):
            await call({"max_tokens": 12, "top_k": 20})
        out = await call({"max_tokens": 12, "temperature": 1.0})
        await client.post("/finish", body={"reward": 0.5}, cast_to=object)
        return out

    out = asyncio.run(run())
    assert len(out["completion_ids"]) == len(out["completion_logprobs"]) == 12
    assert loom_up.wait_job(job.json()["id"], timeout=60)["completed"] == 1
    (t,) = api.get(f"/v1/jobs/{job.json()['id']}/trajectories").json()["items"]
    (step,) = t["steps"]
    assert step["prompt_ids"] == out["prompt_ids"] and step["output_ids"] == out["completion_ids"]
    assert step["output_logprobs"] == pytest.approx(out["completion_logprobs"])
    assert t["reward"] == 0.5

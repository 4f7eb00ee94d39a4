"""An agent written against the OpenAI API, using the official `openai` package unmodified, drives every
session of an external job through `loom up`: two turns each (the second streamed), with tools, then finish.

On the simulated engines the replies are placeholder tokens; a tiny Qwen3 trained here to call a calculator
(``loom.trainer.chat_sft``) and served by the transformers engine makes real tool calls."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from loom import checkpoints as policy
from loom.integrations.trl.rollout import rows_of
from loom.integrations.verl.samples import sample_of
from loom.protocol import Trajectory
from loom.text import chat
from loom.trainer import grpo
from loom.trainer.chat_sft import chat_sequence
from loom.trainer.warmstart import TINY_POLICY, WarmStartConfig, fit
from tests.e2e.conftest import LoomUp, start_loom_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


async def _agent(base_url: str, token: str, question: str) -> dict[str, Any]:
    """One session: a chat turn with tools, a tool result (or a nudge), a streamed turn, finish."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer with the calculator's help."},
        {"role": "user", "content": question},
    ]
    first = await client.chat.completions.create(
        model="qwen3-8b", messages=messages, tools=TOOLS, logprobs=True, extra_body={"return_token_ids": True}
    )
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if reply.tool_calls:
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "4"} for c in reply.tool_calls]
    else:
        messages.append({"role": "user", "content": "Use the calculator, please."})
    text, finish, token_ids, usage = "", None, [], None
    stream = await client.chat.completions.create(
        model="qwen3-8b",
        messages=messages,
        tools=TOOLS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            token_ids += (c.model_extra or {}).get("token_ids") or []
    done = await client.post("/finish", body={"reward": 1.0}, cast_to=object)
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model="qwen3-8b", messages=messages)
    return {"first": first, "second": (text, finish, token_ids, usage), "done": done, "messages": messages}


def test_the_openai_client_drives_every_session_of_an_external_job(loom_up: LoomUp) -> None:
    token = (loom_up.home / "api_token").read_text().strip()
    api = openai.OpenAI(base_url=f"{loom_up.api}/v1", api_key=token, max_retries=0)
    spec = {
        "env": "external",
        "tasks": [{"id": f"q{i}", "data": {"question": f"What is {i} + {i}?"}} for i in range(4)],
        "group_size": 2,
        "max_turn_tokens": 24,
        "session_idle_s": 120,
    }
    job = api.post("/jobs", body=spec, cast_to=object)
    sessions = api.get(f"/jobs/{job['id']}/sessions", cast_to=object)["sessions"]  # type: ignore[index]
    assert len(sessions) == 8 and all(
        s["base_url"].endswith(f"/v1/sessions/{s['session_id']}/v1") for s in sessions
    )

    async def everyone() -> list[dict[str, Any]]:
        return await asyncio.gather(
            *(_agent(s["base_url"], s["api_key"], s["task"]["data"]["question"]) for s in sessions)
        )

    # A session's key opens that session alone: not another one, not the rest of the API.
    other = openai.OpenAI(base_url=sessions[1]["base_url"], api_key=sessions[0]["api_key"], max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        other.models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{loom_up.api}/v1", api_key=sessions[0]["api_key"], max_retries=0).get(
            "/jobs", cast_to=object
        )
    runs = asyncio.run(everyone())
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{loom_up.api}/v1/sessions/job-0.t00000-s000/v1", api_key=token).models.list()
    finished = loom_up.wait_job(job["id"], timeout=120)
    assert finished["state"] == "completed" and finished["completed"] == 8 and finished["failed"] == 0, (
        finished
    )
    trajs = {t["traj_id"]: t for t in api.get(f"/jobs/{job['id']}/trajectories", cast_to=object)["items"]}  # type: ignore[index]
    assert len(trajs) == 8
    for s, run in zip(sessions, runs, strict=True):
        t = trajs[s["traj_id"]]
        assert t["status"] == "completed" and t["reward"] == 1.0 and run["done"]["steps"] == 2, t
        first, second = t["steps"]
        for step in (first, second):
            assert step["prompt_ids"] and step["output_ids"] and not step["rebased"]
            assert len(step["output_logprobs"]) == len(step["output_ids"]) == 24
        # The first reply's ids and log-probs are the trajectory's, as the agent saw them.
        c = run["first"].choices[0]
        assert run["first"].prompt_token_ids == first["prompt_ids"]
        assert c.model_extra["token_ids"] == first["output_ids"]
        assert [x.logprob for x in c.logprobs.content] == pytest.approx(first["output_logprobs"])
        assert '"name": "calculator"' in chat.decode(first["prompt_ids"])
        # The second call added only the new messages' ids after the first reply's, none re-tokenised.
        assert chat.decode(second["prompt_ids"]) == chat.continuation(run["messages"][3:], ended=False)
        text, finish, token_ids, usage = run["second"]
        assert token_ids == second["output_ids"] and finish == "length" and text == second["action"]
        assert usage.completion_tokens == 24
        assert usage.prompt_tokens == len(first["prompt_ids"]) + 24 + len(second["prompt_ids"])


def test_the_example_agent_script_drives_an_external_job(loom_up: LoomUp) -> None:
    """examples/openai-agent/agent.py, a script of nothing but `openai`, as a user runs it."""
    token = (loom_up.home / "api_token").read_text().strip()
    script = Path(__file__).parents[2] / "examples" / "openai-agent" / "agent.py"
    cmd = [sys.executable, str(script), "--api", loom_up.api, "--token", token, "--tasks", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["sessions"] == 8
    job = loom_up.wait_job(out["job"], timeout=120)
    assert job["completed"] == 8 and job["failed"] == 0, job
    api = openai.OpenAI(base_url=f"{loom_up.api}/v1", api_key=token, max_retries=0)
    for t in api.get(f"/jobs/{out['job']}/trajectories", cast_to=object)["items"]:  # type: ignore[index]
        assert len(t["steps"]) == 2 and t["reward"] is not None
        assert all(
            s["prompt_ids"] and len(s["output_ids"]) == len(s["output_logprobs"]) == 64 for s in t["steps"]
        )


def test_a_rewritten_history_is_rebased_and_completions_extend_the_context(loom_up: LoomUp) -> None:
    """An agent that edits its history gets a fresh render, marked; a completion whose prompt ids extend the
    context adds only the new ids; finishing without a reward leaves it to the job's reward function."""
    token = (loom_up.home / "api_token").read_text().strip()
    api = openai.OpenAI(base_url=f"{loom_up.api}/v1", api_key=token, max_retries=0)
    spec = {
        "env": "external",
        "tasks": [{"id": "q", "data": {}}],
        "group_size": 1,
        "max_turn_tokens": 8,
        "reward": "tests.integration.reward_fns:verdict",
    }
    job = api.post("/jobs", body=spec, cast_to=object)
    (s,) = api.get(f"/jobs/{job['id']}/sessions", cast_to=object)["sessions"]  # type: ignore[index]
    agent = openai.OpenAI(base_url=s["base_url"], api_key=token, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    agent.chat.completions.create(model="m", messages=messages)
    edited = [
        *messages,
        {"role": "assistant", "content": "something I did not say"},
        {"role": "user", "content": "?"},
    ]
    second = agent.chat.completions.create(model="m", messages=edited, extra_body={"return_token_ids": True})
    context = second.model_extra["prompt_token_ids"] + second.choices[0].model_extra["token_ids"]
    more = chat.encode(chat.continuation([{"role": "user", "content": "go on"}], ended=False))
    third = agent.completions.create(model="m", prompt=context + more, max_tokens=4, logprobs=0)
    assert len(third.choices[0].logprobs.token_logprobs) == 4
    with pytest.raises(openai.BadRequestError, match="echo"):
        agent.completions.create(model="m", prompt="x", echo=True)
    agent.post("/finish", body={"reward": None}, cast_to=object)
    assert loom_up.wait_job(job["id"], timeout=60)["completed"] == 1
    (t,) = api.get(f"/jobs/{job['id']}/trajectories", cast_to=object)["items"]  # type: ignore[index]
    assert [st["rebased"] for st in t["steps"]] == [False, True, False]
    assert t["steps"][2]["prompt_ids"] == more and t["info"]["rebased_steps"] == 1
    assert t["reward"] == 0.5  # the job's reward function, as the agent gave none


def test_stop_n_and_top_logprobs_are_honoured_and_every_sample_recorded(loom_up: LoomUp) -> None:
    """A chat call with stop strings, n=4 and top_logprobs=5: four choices, none containing a stop string,
    each with its ids, log-probs and five alternatives per token; the agent goes on from choice `pick`, which
    the trajectory's step records (the other three as its siblings); a completion with n=2 and a logprobs
    count extends that path. The trajectory stays one trainable sequence."""
    token = (loom_up.home / "api_token").read_text().strip()
    api = openai.OpenAI(base_url=f"{loom_up.api}/v1", api_key=token, max_retries=0)
    spec = {"env": "external", "tasks": [{"id": "q", "data": {}}], "group_size": 1, "max_turn_tokens": 32}
    job = api.post("/jobs", body=spec, cast_to=object)
    (s,) = api.get(f"/jobs/{job['id']}/sessions", cast_to=object)["sessions"]  # type: ignore[index]
    agent = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    stops = ["e", "\n"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = agent.chat.completions.create(
        model="m",
        messages=messages,
        stop=stops,
        n=4,
        logprobs=True,
        top_logprobs=5,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.message.content or "" for c in first.choices]
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert len({tuple(i) for i in ids}) == 4  # four samples, not one four times
    assert first.usage.completion_tokens == sum(map(len, ids))
    for c, text, out in zip(first.choices, texts, ids, strict=True):
        assert not any(x in text for x in stops) and chat.decode(out).startswith(text)
        assert c.finish_reason == "stop" or (c.finish_reason == "length" and len(out) == 32)
        assert len(c.logprobs.content) == len(out)
        for entry in c.logprobs.content:
            alts = [a.logprob for a in entry.top_logprobs]
            assert len(alts) == 5 and alts == sorted(alts, reverse=True) and entry.logprob in alts
    assert any(c.finish_reason == "stop" for c in first.choices)
    pick = next(i for i in (2, 3, 1, 0) if texts.count(texts[i]) == 1)
    messages += [first.choices[pick].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
    second = agent.chat.completions.create(
        model="m", messages=messages, max_tokens=4, extra_body={"return_token_ids": True}
    )
    context = second.model_extra["prompt_token_ids"] + second.choices[0].model_extra["token_ids"]
    more = chat.encode(chat.continuation([{"role": "user", "content": "and?"}], ended=False))
    third = agent.completions.create(
        model="m", prompt=context + more, max_tokens=6, n=2, logprobs=3, stop=["e"]
    )
    assert [c.index for c in third.choices] == [0, 1]
    for c in third.choices:
        assert "e" not in c.text and len(c.logprobs.top_logprobs) == len(c.logprobs.tokens)
        assert all(1 <= len(alts) <= 3 for alts in c.logprobs.top_logprobs)
    agent.post("/finish", body={"reward": 1.0}, cast_to=object)
    assert loom_up.wait_job(job["id"], timeout=60)["completed"] == 1
    (item,) = api.get(f"/jobs/{job['id']}/trajectories", cast_to=object)["items"]  # type: ignore[index]
    t = msgspec.convert(item, Trajectory)
    one, two, three = t.steps
    # The step is the choice the agent went on from; its siblings are the other three, ids and log-probs.
    assert one.choice == pick and one.output_ids == ids[pick] and one.action == texts[pick]
    assert one.output_logprobs == pytest.approx([x.logprob for x in first.choices[pick].logprobs.content])
    assert [(x.choice, x.output_ids) for x in one.siblings or []] == [
        (i, ids[i]) for i in range(4) if i != pick
    ]
    assert all(len(x.output_logprobs or []) == len(x.output_ids or []) for x in one.siblings or [])
    ended = chat.ended(ids[pick])
    assert two.prompt_ids == chat.encode(chat.continuation(messages[2:], ended=ended)) and not two.rebased
    assert two.siblings is None and three.prompt_ids == more and not three.rebased
    assert three.choice == 0 and len(three.siblings or []) == 1
    flat = grpo.flatten(t)  # the path the agent took, one sequence
    assert flat.ids.tolist() == [
        i for st in t.steps for i in (*(st.prompt_ids or []), *(st.output_ids or []))
    ]
    row, sample = rows_of(t), sample_of(t)  # TRL's and verl's views of it, the same path
    assert row.prompt_ids + row.completion_ids == flat.ids.tolist() == sample.prompt_ids + sample.response_ids


def test_an_agent_solves_a_built_in_task_set_scored_by_its_reward(loom_up: LoomUp) -> None:
    """GSM8K through the gateway: the session's task carries the question, and finish(null) is scored by the
    math reward against the set's answer (an external job used to refuse built-in sets with a 422)."""
    token = (loom_up.home / "api_token").read_text().strip()
    api = openai.OpenAI(base_url=f"{loom_up.api}/v1", api_key=token, max_retries=0)
    spec = {"env": "external", "dataset": {"name": "gsm8k", "limit": 2}, "group_size": 1, "reward": "math"}
    job = api.post("/jobs", body=spec, cast_to=object)
    sessions = api.get(f"/jobs/{job['id']}/sessions", cast_to=object)["sessions"]  # type: ignore[index]
    assert len(sessions) == 2
    for s in sessions:
        question = s["task"]["data"]["prompt"]
        assert s["task"]["data"]["set"] == "gsm8k" and "?" in question
        agent = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        agent.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], max_tokens=8
        )
        agent.post("/finish", body={"reward": None}, cast_to=object)
    assert loom_up.wait_job(job["id"], timeout=60)["completed"] == 2
    items = api.get(f"/jobs/{job['id']}/trajectories", cast_to=object)["items"]  # type: ignore[index]
    # The simulated engine's placeholder reply is no answer: the math reward scores it, and scores it 0.
    assert [t["reward"] for t in items] == [0.0, 0.0]


SYSTEM = "Answer with the calculator's help."
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "2+2"}}}],
}
ANSWER = "The answer is 4."


def _demonstration(question: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
        CALL,
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": ANSWER},
    ]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 that calls the calculator, then answers from its result (about 50 steps, ~10 s)."""
    flats = [
        chat_sequence(_demonstration(f"What is {a} + {b}?"), TOOLS) for a in range(10) for b in range(10)
    ]
    rng = random.Random(0)
    model = policy.build_tiny(0, **TINY_POLICY)
    draw = lambda _: grpo.collate([rng.choice(flats) for _ in range(8)], [1.0] * 8)  # noqa: E731
    res = fit(model, draw, 200, 3e-3, WarmStartConfig(), stop=lambda _, loss: loss < 0.01)
    assert res["loss"] < 0.01, res
    return policy.save(model, tmp_path_factory.mktemp("tool-model") / "ckpt")


@pytest.fixture(scope="module")
def hf_loom_up(tmp_path_factory: pytest.TempPathFactory, tool_model: Path) -> Iterator[LoomUp]:
    yield from start_loom_up(
        tmp_path_factory.mktemp("loom-hf"),
        "--engine",
        "hf",
        "--model-path",
        str(tool_model),
        "--workers",
        "1",
    )


def test_a_model_that_calls_tools_serves_an_openai_agent(hf_loom_up: LoomUp) -> None:
    """Greedy replies of the tool model: a calculator call the client reads as tool_calls, then, after the
    agent's tool result, a streamed answer; the trajectory is one trainable sequence, loss on the replies."""
    up = hf_loom_up
    token = (up.home / "api_token").read_text().strip()
    api = openai.OpenAI(base_url=f"{up.api}/v1", api_key=token, max_retries=0)
    spec: dict[str, Any] = {
        "env": "external",
        "tasks": [{"id": "q", "data": {"question": "What is 3 + 5?"}}],
        "group_size": 2,
    }
    # Without max_tokens a call may generate the job's whole budget (40,960), past this model's 2,048
    # positions: the engine refuses it, the agent is told why (400), and its session goes on.
    job = api.post("/jobs", body=spec, cast_to=object)
    s = api.get(f"/jobs/{job['id']}/sessions", cast_to=object)["sessions"][0]  # type: ignore[index]
    agent = openai.OpenAI(base_url=s["base_url"], api_key=token, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="exceeds this engine's limit"):
        agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    agent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    agent.post("/finish", body={"reward": 0.0}, cast_to=object)
    api.delete(f"/jobs/{job['id']}", cast_to=object)  # its other session is not driven
    spec["max_turn_tokens"] = 64
    job = api.post("/jobs", body=spec, cast_to=object)
    sessions = api.get(f"/jobs/{job['id']}/sessions", cast_to=object)["sessions"]  # type: ignore[index]
    for s in sessions:
        agent = openai.OpenAI(base_url=s["base_url"], api_key=token, max_retries=0)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": s["task"]["data"]["question"]},
        ]
        first = agent.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0)
        (call,) = first.choices[0].message.tool_calls or []
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "2+2"}
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "4"},
        ]
        stream = agent.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=0, stream=True, logprobs=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
        assert chunks[-1].choices[0].finish_reason == "stop"
        agent.post("/finish", body={"reward": 1.0}, cast_to=object)
    assert up.wait_job(job["id"], timeout=120)["completed"] == 2
    for item in api.get(f"/jobs/{job['id']}/trajectories", cast_to=object)["items"]:  # type: ignore[index]
        t = msgspec.convert(item, Trajectory)
        first, second = t.steps
        assert chat.reply_text(first.output_ids or []) == chat.assistant_text(CALL)
        # After the call's own end token: only the tool result and the next generation prompt.
        tool = chat.continuation([{"role": "tool", "content": "4"}], ended=True)
        assert second.prompt_ids == chat.encode(tool) and not second.rebased
        flat = grpo.flatten(t)  # one sequence, as the trainer SDK trains it
        assert int(flat.loss_mask.sum()) == len(first.output_ids or []) + len(second.output_ids or [])
        assert flat.ids.tolist() == [
            *(first.prompt_ids or []),
            *(first.output_ids or []),
            *(second.prompt_ids or []),
            *(second.output_ids or []),
        ]

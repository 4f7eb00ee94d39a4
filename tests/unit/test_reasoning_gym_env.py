"""reasoning-gym's datasets as Loom environments (loom.envs.adapters.reasoning_gym), on the real package."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest

from loom.envs import actions, registry
from loom.envs.adapters import LibraryError
from loom.envs.adapters import reasoning_gym as rg
from loom.protocol import JobSpec, TaskSpec
from services.scheduler.tasks import SpecError, resolve_tasks

reasoning_gym = pytest.importorskip("reasoning_gym")


def _tasks(body: dict[str, Any]) -> list[TaskSpec]:
    return resolve_tasks(msgspec.convert(body, JobSpec), None)


def _episode(env: Any, action: str) -> tuple[str, dict[str, Any]]:
    async def run() -> tuple[str, dict[str, Any]]:
        prompt = await env.reset()
        assert (await env.step(actions.parse(action))).done
        return prompt, env.verdict()

    return asyncio.run(run())


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "letter_counting", "spell_backward"])
def test_tasks_come_from_the_generator_and_the_scripted_answer_scores(dataset: str) -> None:
    env = f"reasoning_gym:{dataset}"
    tasks = _tasks({"env": env, "dataset": {"limit": 4}, "scripted": True})
    assert [t.id for t in tasks] == ["0", "1", "2", "3"]
    ds = reasoning_gym.create_dataset(dataset, seed=0)
    for t in tasks:
        item = ds[int(t.id)]
        assert (
            t.data["set"] == env and t.data["params"] == {"seed": 0} and t.data["prompt"] == item["question"]
        )
        script = registry.reference_actions(env, t)
        prompt, verdict = _episode(registry.make(env, t, None, 10.0), script[0])
        assert prompt == f"{rg.SYSTEM}\nQuestion: {item['question']}\n"
        assert verdict["score"] > 0 and verdict["score"] == ds.score_answer(item["answer"], item)


def test_env_params_reach_create_dataset_and_answers_are_scored_by_the_dataset() -> None:
    params = {"size": 3, "seed": 7, "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    tasks = _tasks({"env": "reasoning_gym:chain_sum", "env_params": params, "dataset": {}})
    ds = reasoning_gym.create_dataset("chain_sum", **params)
    assert [t.data["prompt"] for t in tasks] == [ds[i]["question"] for i in range(3)]
    assert all(t.data["params"] == params for t in tasks)
    answer = ds[0]["answer"]
    # ReAct's Finish[...] and the finish tool call are both answers; a wrong one scores what the dataset says.
    for action, score in [
        (f"Thought: done.\nAction: Finish[{answer}]", 1.0),
        (actions.json_call("finish", answer=int(answer)), 1.0),
        ("Finish[nonsense]", ds.score_answer("nonsense", ds[0])),
    ]:
        _, verdict = _episode(registry.make("reasoning_gym:chain_sum", tasks[0], None, 10.0), action)
        assert verdict["score"] == score, (action, verdict)
    # Another tool is not an answer: the model is told so and may answer next turn.
    env = registry.make("reasoning_gym:chain_sum", tasks[0], None, 10.0)

    async def other_tool() -> str:
        await env.reset()
        obs = await env.step(actions.parse("Search[x]"))
        assert not obs.done
        return obs.text

    assert "Unknown tool 'Search'" in asyncio.run(other_tool())


def test_the_same_tasks_in_another_process() -> None:
    """The scheduler, the environment managers and the reward service generate the tasks apart."""
    here = [t.data["prompt"] for t in _tasks({"env": "reasoning_gym:chain_sum", "dataset": {"limit": 3}})]
    code = (
        "from loom.envs import registry; from loom.protocol import TaskSpec;"
        "print([registry.task_of(TaskSpec(id=str(i), data={'set': 'reasoning_gym:chain_sum', "
        "'params': {'seed': 0}}))['question'] for i in range(3)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(here)


def test_bad_specs_are_refused_at_submission_with_the_field() -> None:
    cases = [
        ({"env": "reasoning_gym:chain_summ", "dataset": {"limit": 4}}, ["env"], "did you mean chain_sum"),
        (
            {"env": "reasoning_gym:chain_sum", "env_params": {"min_terms": 0}},
            ["env_params"],
            "must be positive",
        ),
        ({"env": "reasoning_gym:chain_sum", "env_params": {"colour": 1}}, ["env_params"], "colour"),
        ({"env": "reasoning_gym:chain_sum", "env_params": {"size": 10**9}}, ["env_params"], "more tasks"),
        # Its items carry no answer to script from.
        ({"env": "reasoning_gym:propositional_logic", "scripted": True}, ["scripted"], "no reference answer"),
        (
            {"env": "reasoning_gym:chain_sum", "env_params": {"size": 2}, "dataset": {"offset": 2}},
            None,
            "past",
        ),
    ]
    for body, loc, why in cases:
        with pytest.raises(SpecError, match=why) as e:
            _tasks({"dataset": {}, **body})
        assert loc is None or e.value.loc == loc, e.value


def test_a_missing_package_is_a_clear_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` meets uninstalled
    rg._dataset.cache_clear()
    with pytest.raises(SpecError, match=r"pip install 'loom\[reasoning_gym\]'") as e:
        _tasks({"env": "reasoning_gym:chain_sum", "dataset": {"limit": 4}})
    assert e.value.loc == ["env"]


def test_the_librarys_errors_and_hangs_fail_the_trajectory_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (task,) = _tasks({"env": "reasoning_gym:chain_sum", "dataset": {"limit": 1}})
    env = registry.make("reasoning_gym:chain_sum", task, None, 0.5)
    assert isinstance(env, rg.ReasoningGymEnv)

    async def answer_with(record: dict[str, Any]) -> None:
        await env.reset()
        env.record = record
        await env.step(actions.parse("Finish[1]"))

    # The dataset's own score_answer on an item it cannot read raises.
    with pytest.raises(LibraryError, match=r"chain_sum: score_answer raised KeyError"):
        asyncio.run(answer_with({}))
    # One that does not return in time is left behind (a thread cannot be stopped), and the trajectory fails
    # at the timeout.
    ds = rg._dataset("chain_sum", rg._key(task.data["params"]))
    monkeypatch.setattr(ds, "score_answer", lambda answer, entry: time.sleep(2) or 1.0)

    async def hung() -> float:
        await env.reset()
        t0 = time.monotonic()
        with pytest.raises(LibraryError, match=r"score_answer did not return within 0.5 s"):
            await env.step(actions.parse("Finish[1]"))
        return time.monotonic() - t0

    assert asyncio.run(hung()) < 1.5
    bad = registry.make("reasoning_gym:chain_sum", TaskSpec(id="99999", data=task.data), None, 5.0)
    with pytest.raises(LibraryError, match="has no task '99999'"):
        asyncio.run(bad.reset())

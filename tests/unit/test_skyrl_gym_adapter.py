"""SkyRL-Gym's text environments as Loom environments (loom.envs.adapters.skyrl_gym), on the real package:
the tasks SkyRL's preprocessing would make of Loom's GSM8K data, the library's own rewards, the job spec's
refusals, and a trajectory's token ids through the user loop and Qwen3's chat template."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import msgspec
import pytest

from loom.clock import Clock
from loom.envs import registry, tasksets
from loom.envs.adapters import LibraryError, LibraryMissing
from loom.envs.adapters import skyrl_gym as sg
from loom.envs.api import Action, StepResult
from loom.protocol import GenRequest, GenResult, JobSpec, TaskSpec, ToolLatency, TrajWork
from loom.text import chat
from loom.text.tokenizer import IM_END
from services.envmgr.context import LoopContext
from services.envmgr.user_loop import run_user_env
from services.scheduler.tasks import SpecError, resolve_tasks

skyrl_gym = pytest.importorskip("skyrl_gym")
from skyrl_gym.envs.gsm8k.utils import compute_score  # noqa: E402  (after the importorskip)

MULTI = "skyrl_gym:gsm8k_multi_turn"
SINGLE = "skyrl_gym:gsm8k"


def _tasks(body: dict[str, Any]) -> list[TaskSpec]:
    return resolve_tasks(msgspec.convert(body, JobSpec), None)


def _refused(body: dict[str, Any]) -> SpecError:
    with pytest.raises(SpecError) as e:
        _tasks(body)
    return e.value


def _act(text: str) -> Action:
    reply = chat.parse_reply(text)
    return Action(text, reply.content, reply.tool_calls)


def _play(
    env: str, spec: TaskSpec, replies: list[str], **params: Any
) -> tuple[Any, list[Any], list[StepResult]]:
    """Reset ``env``'s class as the environment manager makes it, then step it with ``replies`` until done."""

    async def run() -> tuple[Any, list[Any], list[StepResult]]:
        e = registry.user_class(env, lambda path: pytest.fail(f"{path} is a library's, not an import path"))(
            **params
        )
        first = await e.reset(dict(spec.data))
        results = []
        for text in replies:
            results.append(await e.step(_act(text)))
            if results[-1].done:
                break
        await e.close()
        return e, first, results

    return asyncio.run(run())


def test_tasks_are_gsm8k_rows_as_skyrl_preprocessing_builds_them() -> None:
    data = tasksets.gsm8k(None, "test")
    for env, instruction in [
        (MULTI, 'output a tentative numeric answer after "####".'),
        (SINGLE, 'output the final answer after "####".'),
    ]:
        tasks = _tasks({"env": env, "dataset": {"limit": 3}, "group_size": 2})
        assert [t.id for t in tasks] == ["gsm8k-test/0", "gsm8k-test/1", "gsm8k-test/2"]
        name = env.split(":")[1]
        for t in tasks:
            truth = data[t.id]
            assert t.data["set"] == env and t.data["task_id"] == t.id
            assert t.data["params"] == (
                {"split": "test", "max_turns": 5} if env == MULTI else {"split": "test"}
            )
            assert t.data["prompt"] == f"{truth.question} Let's think step by step and {instruction}"
            row = registry.task_of(t)
            assert (
                row["prompt"] == [{"role": "user", "content": t.data["prompt"]}] and row["env_class"] == name
            )
            assert row["reward_spec"] == {"method": "rule", "ground_truth": truth.answer}
            assert row["extra_info"]["answer"] == truth.solution
            # What reaches skyrl_gym.make: the row less its prompt and env class, as SkyRL's generator passes it.
            extras = sg.extras(row, t.data["params"])
            assert "prompt" not in extras and extras["reward_spec"] == row["reward_spec"]
    train = _tasks({"env": MULTI, "env_params": {"split": "train"}, "dataset": {"offset": 5, "limit": 2}})
    assert [t.id for t in train] == ["gsm8k-train/5", "gsm8k-train/6"]
    listed = _tasks({"env": SINGLE, "tasks": [{"id": "gsm8k-test/42"}]})
    assert listed[0].data["prompt"].startswith(data["gsm8k-test/42"].question)


def test_unknown_environments_params_and_a_missing_library_are_refused_at_submission(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    e = _refused({"env": "skyrl_gym:gsm8k_multiturn", "dataset": {"limit": 4}})
    assert e.loc == ["env"] and "did you mean gsm8k_multi_turn" in e.msg and "text2sql" in e.msg
    # Registered by the library, but its tasks need data Loom does not have: refused by name, not failed later.
    for name in ("aime", "text2sql", "search", "searchcode", "lcb"):
        e = _refused({"env": f"skyrl_gym:{name}", "dataset": {"limit": 4}})
        assert e.loc == ["env"] and f"skyrl-gym's {name} needs" in e.msg and "Loom does not ship" in e.msg
    for params, words in [
        ({"max_turns": 3}, "not ['max_turns']"),  # the single-turn environment has no turns to set
        ({"split": "validation"}, "split must be one of"),
        ({"env_config": 3}, "env_config must be an object"),
    ]:
        e = _refused({"env": SINGLE, "env_params": params, "dataset": {"limit": 4}})
        assert e.loc == ["env_params"] and words in e.msg, e.msg
    for turns in (0, True, "5", 1001):
        e = _refused({"env": MULTI, "env_params": {"max_turns": turns}, "dataset": {"limit": 4}})
        assert e.loc == ["env_params"] and "max_turns must be" in e.msg
    e = _refused({"env": MULTI, "dataset": {"name": "gsm8k", "limit": 4}})
    assert e.loc == ["dataset", "name"] and "generates its tasks" in e.msg
    e = _refused({"env": MULTI, "tasks": [{"id": "gsm8k-test/99999"}]})
    assert e.loc == ["tasks", 0, "id"] and "gsm8k-test/0 to gsm8k-test/1318" in e.msg
    e = _refused({"env": MULTI, "dataset": {"offset": 1319}})
    assert e.loc == ["dataset", "offset"]
    # Scripted jobs are checked for a reference reply at submission, and have one.
    assert len(_tasks({"env": MULTI, "dataset": {"limit": 2}, "scripted": True})) == 2
    # A process without the library: a clear 422 naming the extra to install.
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    e = _refused({"env": MULTI, "dataset": {"limit": 4}})
    assert e.loc == ["env"] and "pip install 'loom[skyrl_gym]'" in e.msg
    with pytest.raises(LibraryMissing):
        sg.environment.__wrapped__("gsm8k")


def test_the_library_scores_replies_and_its_turns_follow_its_own_rules() -> None:
    (spec,) = _tasks({"env": MULTI, "tasks": [{"id": "gsm8k-test/0"}]})
    truth = tasksets.gsm8k(None, "test")["gsm8k-test/0"].answer
    env, first, results = _play(MULTI, spec, ["I do not know.", "#### 3", f"So it is\n#### {truth}", "x"])
    assert first == [{"role": "user", "content": spec.data["prompt"]}]
    # Unformatted 0, formatted but wrong 0.2 / max_turns, right 1.0 (which ends the episode): SkyRL's rewards.
    assert [r.reward for r in results] == [0, pytest.approx(0.2 / 5), 1.0]
    assert [r.done for r in results] == [False, False, True]
    assert "'#### ANSWER'" in results[0].observation[0]["content"]  # type: ignore[index]
    assert results[-1].observation == [] and results[-1].info["metrics"] == {"steps": 3}
    # env_params reach the environment where SkyRL-Gym reads them: max_turns in its extras.
    (short,) = _tasks({"env": MULTI, "env_params": {"max_turns": 2}, "tasks": [{"id": "gsm8k-test/0"}]})
    env, _, results = _play(MULTI, short, ["a", "b", "c"], max_turns=2)
    assert env.env is None and len(results) == 2 and results[-1].done and results[-1].reward == 0
    assert "only the final numeric answer" in results[0].observation[0]["content"]  # type: ignore[index]
    # The single-turn environment is done after one reply, right or wrong.
    (single,) = _tasks({"env": SINGLE, "tasks": [{"id": "gsm8k-test/1"}]})
    right = tasksets.gsm8k(None, "test")["gsm8k-test/1"].answer
    for reply, reward in [(f"#### {right}", 1.0), ("#### -1", 0)]:
        _, _, results = _play(SINGLE, single, [reply])
        assert [(r.reward, r.done) for r in results] == [(reward, True)]


def test_scripted_replies_score_1_by_the_library() -> None:
    """The adapter's reference reply for every GSM8K test task is one SkyRL's reward function scores 1.0."""
    tasks = _tasks({"env": MULTI, "dataset": {}, "scripted": True})
    assert len(tasks) == 1319
    for t in tasks:
        row = registry.task_of(t)
        (reply,) = registry.reference_actions(MULTI, t)
        assert compute_score(reply, row["reward_spec"]["ground_truth"]) == 1.0
        assert compute_score(f"#### {row['reward_spec']['ground_truth']}", row["reward_spec"]["ground_truth"])

    async def scripted() -> list[str]:
        env = sg.environment("gsm8k_multi_turn")()
        await env.reset(dict(tasks[3].data))
        said = [env.reference_action()]
        await env.step(_act("wrong"))  # the environment asks again: the script answers what it asks for
        said.append(env.reference_action())
        result = await env.step(_act(said[-1]))
        assert result.reward == 1.0 and result.done
        return said

    worked, bare = asyncio.run(scripted())
    assert worked == tasksets.gsm8k(None, "test")[tasks[3].id].solution
    assert bare == f"#### {tasksets.gsm8k(None, 'test')[tasks[3].id].answer}"


def test_the_librarys_errors_and_hangs_fail_only_the_trajectory(monkeypatch: pytest.MonkeyPatch) -> None:
    (spec,) = _tasks({"env": MULTI, "tasks": [{"id": "gsm8k-test/0"}]})
    cls = sg.environment("gsm8k_multi_turn")

    async def step_with(fn: Any, timeout_s: float) -> tuple[StepResult | None, float]:
        env = cls()
        await env.reset(dict(spec.data))
        monkeypatch.setattr(env.env, "step", fn)
        t0 = time.perf_counter()
        try:
            result: StepResult = await asyncio.wait_for(env.step(_act("x")), timeout_s)
            return result, time.perf_counter() - t0
        except TimeoutError:
            return None, time.perf_counter() - t0
        finally:
            monkeypatch.undo()

    def broken(action: str) -> Any:
        raise RuntimeError("its database is gone")

    with pytest.raises(LibraryError, match="step raised RuntimeError: its database is gone"):
        asyncio.run(step_with(broken, 5.0))

    def slow(action: str) -> Any:
        time.sleep(0.5)
        return {"observations": [], "reward": 0.0, "done": True, "metadata": {}}

    # Blocking library code runs in a thread, so the user loop's timeout ends the step on time.
    result, took = asyncio.run(step_with(slow, 0.1))
    assert result is None and took < 0.3

    def odd(action: str) -> Any:
        return "not a step output"

    with pytest.raises(LibraryError, match="not a BaseTextEnvStepOutput"):
        asyncio.run(step_with(odd, 5.0))


class _Engine:
    """Replies with the given texts' ids, ended by <|im_end|>, and a log-prob per token."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = [[*chat.encode(r), IM_END] for r in replies]
        self.inputs: list[list[int]] = []

    async def generate(self, req: GenRequest) -> GenResult:
        assert req.input_ids is not None
        self.inputs.append(list(req.input_ids))
        out = self.replies[len(self.inputs) - 1]
        return GenResult(
            rid=req.rid,
            worker_id="w0",
            output_len=len(out),
            finish_reason="stop",
            output_ids=out,
            output_logprobs=[-0.5] * len(out),
        )


def test_a_trajectory_through_the_user_loop_is_token_exact_under_qwen3s_template() -> None:
    """The environment manager's loop over this adapter: the prompt is Qwen3's template over SkyRL's first
    messages, each later step adds only the observation's ids after the engine's own output ids, and the
    whole context is what the template makes of the whole chat; the reward is the sum of SkyRL's."""
    (spec,) = _tasks({"env": MULTI, "tasks": [{"id": "gsm8k-test/2"}]})
    truth = tasksets.gsm8k(None, "test")["gsm8k-test/2"].answer
    replies = ["Let me see.", "#### 1", f"It is\n#### {truth}"]
    engine = _Engine(replies)
    ctx = LoopContext(nc=None, clock=Clock(), gen=engine, predict_timeout_s=0.01)  # type: ignore[arg-type]
    work = TrajWork(
        job_id="job-1",
        traj_id="t00000-s000",
        task=spec,
        group=0,
        sample=0,
        env=MULTI,
        model="qwen3-8b",
        max_turns=10,
        max_tokens=4096,
        tool_latency=ToolLatency(),
    )
    traj = asyncio.run(run_user_env(work, ctx, sg.environment("gsm8k_multi_turn"), None))
    assert traj.status == "completed" and traj.finish_reason == "done" and len(traj.steps) == 3
    assert traj.info["verdict"]["rewards"] == [0.0, pytest.approx(0.04), 1.0]
    assert traj.info["verdict"]["score"] == pytest.approx(1.04)
    messages: list[dict[str, Any]] = [{"role": "user", "content": spec.data["prompt"]}]
    assert traj.steps[0].prompt_ids == chat.encode(chat.render(messages))
    context: list[int] = []
    for k, step in enumerate(traj.steps):
        assert step.output_ids == engine.replies[k] and step.action == replies[k]
        assert step.output_logprobs == [-0.5] * len(engine.replies[k])
        assert engine.inputs[k] == context + (step.prompt_ids or [])
        context = engine.inputs[k] + engine.replies[k]
        messages.append({"role": "assistant", "content": replies[k]})
        if k < 2:
            follow = [{"role": "user", "content": step.observation}]
            assert step.prompt_ids is not None
            assert traj.steps[k + 1].prompt_ids == chat.encode(chat.continuation(follow, ended=True))
            messages += follow
    # The context the engine saw at the last call is the template's rendering of the chat up to it.
    assert engine.inputs[2] == chat.encode(chat.render(messages[:-1]))

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loom.data.traces import load_traces
from loom.envs import tasksets
from loom.protocol import DatasetRef, JobSpec, RewardRequest, TaskSpec, Trajectory
from loom.rewards.context import ground_truth
from services.scheduler.tasks import SpecError, expand, resolve_tasks
from tests.conftest import need_shared


def test_dataset_resolves_to_trace_tasks_and_expands_into_groups() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    spec = JobSpec(dataset=DatasetRef(name="swe-replay", offset=3, limit=2), group_size=3)
    tasks = resolve_tasks(spec, None)
    assert len(tasks) == 2 and all(t.data["trace_id"] == t.id for t in tasks)
    assert all(t.data["siblings"] == "varied" for t in tasks)
    exact = JobSpec(dataset=DatasetRef(name="swe-replay", limit=1, siblings="replay"))
    assert resolve_tasks(exact, None)[0].data["siblings"] == "replay"
    spec.tasks = tasks
    works = expand("job-x", spec)
    assert [w.traj_id for w in works] == [f"t0000{g}-s00{s}" for g in range(2) for s in range(3)]
    assert len({w.seed for w in works}) == 6


def test_invalid_specs_name_the_field() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(), None)
    assert e.value.loc == ["tasks"]
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(tasks=[TaskSpec(id="a"), TaskSpec(id="b", data={"trace_id": "nope"})]), None)
    assert e.value.loc == ["tasks", 0, "data", "trace_id"]
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(dataset=DatasetRef(name="swe-replay", offset=10_000)), None)
    assert e.value.loc == ["dataset", "offset"]
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(dataset=DatasetRef(name="swe-replay", path="/nonexistent.jsonl")), None)
    assert e.value.loc == ["dataset", "path"]
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(dataset=DatasetRef(name="swe-replay"), reward="nonsense"), None)
    assert e.value.loc == ["reward"] and "module:function" in str(e.value)
    first = next(iter(load_traces()))
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(tasks=[TaskSpec(id="a", data={"trace_id": first, "siblings": "cloned"})]), None)
    assert e.value.loc == ["tasks", 0, "data", "siblings"]


def test_reward_tenant_and_params_reach_the_trajectories() -> None:
    spec = JobSpec(
        tasks=[TaskSpec(id="a")], group_size=1, tenant="team-a", reward="pkg.mod:fn", reward_params={"k": 1}
    )
    (w,) = expand("job-x", spec)
    assert (w.tenant, w.reward, w.reward_params) == ("team-a", "pkg.mod:fn", {"k": 1})
    assert expand("job-x", JobSpec(tasks=[TaskSpec(id="a")], group_size=1))[0].reward == "replay"
    assert expand("job-x", JobSpec(env="code", tasks=[TaskSpec(id="a")], group_size=1))[0].reward == "env"


def test_specs_name_only_code_and_files_the_operator_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Findings 3 and 4: a client chooses neither server-side code nor which server files are read."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    ds = DatasetRef(name="swe-replay", limit=1)
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(dataset=ds, reward="os:system"), None)
    assert e.value.loc == ["reward"] and "allowlist" in e.value.msg
    with pytest.raises(SpecError):
        resolve_tasks(JobSpec(dataset=ds, reward="tests.integration.reward_fns_evil:fn"), None)
    resolve_tasks(JobSpec(dataset=ds, reward="tests.integration.reward_fns:busy"), None)

    secret = tmp_path / "secret.jsonl"
    secret.write_text("{}\n")
    monkeypatch.setenv("LOOM_DATA_DIRS", str(tmp_path / "data"))
    messages = []
    for path in (
        "/etc/shadow",
        "/etc/no-such-file",
        str(secret),
        str(tmp_path / "data" / ".." / "secret.jsonl"),
    ):
        with pytest.raises(SpecError) as e:
            resolve_tasks(JobSpec(dataset=DatasetRef(name="swe-replay", path=path)), None)
        assert e.value.loc == ["dataset", "path"]
        messages.append(e.value.msg.replace(path, "P"))
    assert len(set(messages)) == 1  # an existing file outside is not told apart from a missing one
    (tmp_path / "data").mkdir()
    big = tmp_path / "data" / "big.jsonl"
    big.write_bytes(b"x" * 2**20 * 2)
    monkeypatch.setenv("LOOM_DATA_MAX_MB", "1")
    for path, why in (
        ("/dev/zero", "not inside"),
        (str(tmp_path / "data"), "not a regular file"),
        (str(big), "limit"),
    ):
        if path == "/dev/zero":
            monkeypatch.setenv("LOOM_DATA_DIRS", f"{tmp_path / 'data'}{os.pathsep}/dev")
            why = "not a regular file"
        with pytest.raises(SpecError, match=why):
            resolve_tasks(JobSpec(dataset=DatasetRef(name="swe-replay", path=path)), None)
    task = TaskSpec(id="a", data={"set": "gsm8k", "path": "/etc/passwd"})
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(env="math", tasks=[task]), None)
    assert e.value.loc == ["tasks", 0, "data", "path"]


def test_user_environment_tasks_come_inline_or_from_a_jsonl_set_unimported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_DATA_DIRS", str(tmp_path))
    f = tmp_path / "guess.jsonl"
    f.write_text('{"id": "a", "secret": 3}\n\n{"secret": 5}\n{"id": "c", "secret": 9}\n')
    spec = JobSpec(
        env="loom_guess:Guess", dataset=DatasetRef(name="jsonl", path=str(f), offset=1), env_params={"k": 2}
    )
    tasks = resolve_tasks(spec, None)
    assert [(t.id, t.data) for t in tasks] == [("line3", {"secret": 5}), ("c", {"id": "c", "secret": 9})]
    spec.tasks = tasks
    assert {(w.env, w.reward, str(w.env_params)) for w in expand("j", spec)} == {
        ("loom_guess:Guess", "env", "{'k': 2}")
    }
    inline = [TaskSpec(id="x", data={"secret": 1})]
    assert resolve_tasks(JobSpec(env="external", tasks=inline), None) == inline
    # The class's module is checked as text against the allowlist, never imported to check it.
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(env="os:System", tasks=inline), None)
    assert e.value.loc == ["env"] and "allowlist" in e.value.msg
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(env="loom_guess:Guess", tasks=inline, scripted=True), None)
    assert e.value.loc == ["scripted"]
    f.write_text('{"id": "a"}\n{"id": "a"}\n')
    with pytest.raises(SpecError, match="appears twice") as e:
        resolve_tasks(JobSpec(env="loom_guess:Guess", dataset=DatasetRef(name="jsonl", path=str(f))), None)
    assert e.value.loc == ["dataset", "path"]
    with pytest.raises(SpecError) as e:
        resolve_tasks(JobSpec(env="code", dataset=DatasetRef(name="jsonl", path=str(f))), None)
    assert e.value.loc == ["dataset", "name"]


def test_an_external_job_takes_a_built_in_task_set_whose_reward_finds_the_answer() -> None:
    """An agent solving GSM8K through the gateway: the sessions' tasks carry the question, and the math
    reward on finish(null) finds the set's answer (this was a 422: 'takes inline tasks or a jsonl set')."""
    need_shared("data/tasks/gsm8k-test.jsonl")
    spec = JobSpec(env="external", dataset=DatasetRef(name="gsm8k", offset=2, limit=3), reward="math")
    tasks = resolve_tasks(spec, None)
    records = tasksets.gsm8k(None, "test")
    assert [t.id for t in tasks] == list(records)[2:5]
    for t in tasks:
        assert t.data["set"] == "gsm8k" and t.data["prompt"] == records[t.id].question
        req = RewardRequest(_traj(), "math", task=t)
        assert ground_truth(req) == records[t.id].answer
    spec.tasks = tasks
    assert {w.reward for w in expand("j", spec)} == {"math"}
    with pytest.raises(SpecError, match="needs its path") as e:
        resolve_tasks(JobSpec(env="external", dataset=DatasetRef(name="jsonl")), None)
    assert e.value.loc == ["dataset", "path"]


def _traj() -> Trajectory:
    return Trajectory("j", "t", "q", 0, 0, "external", "completed", "done", [], 0.0, 0.0)

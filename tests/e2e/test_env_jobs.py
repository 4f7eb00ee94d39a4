"""Live jobs of every environment through `loom up`: scheduler, router, simulated engines, environment
manager with Docker sandboxes, predictor, reward. The model's actions are scripted from each task's
reference solution, so every reward must be 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loom.envs import actions, hotpotqa
from tests.e2e.conftest import LoomUp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _submit(up: LoomUp, tmp_path: Path, spec: dict[str, Any]) -> str:
    f = tmp_path / "job.json"
    f.write_text(json.dumps(spec))
    r = up.cli("submit", str(f))
    assert r.returncode == 0, r.stdout + r.stderr
    return str(json.loads(r.stdout)["id"])


def _results(up: LoomUp, tmp_path: Path, job_id: str) -> list[dict[str, Any]]:
    out = tmp_path / f"{job_id}.ndjson"
    r = up.cli("results", job_id, "-o", str(out))
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def _search_tasks(n: int) -> list[dict[str, Any]]:
    qas = [q for q in hotpotqa.load().questions if q.reference][:n]
    return [{"id": q.id, "data": {"set": "hotpotqa"}} for q in qas]


@pytest.mark.parametrize(
    ("env", "source", "tools"),
    [
        ("code", {"dataset": {"name": "humaneval", "offset": 0, "limit": 3}}, {"python", "submit"}),
        ("math", {"dataset": {"name": "gsm8k", "offset": 0, "limit": 3}}, {"python", "Finish"}),
        ("search", {"tasks": _search_tasks(3)}, {"Search", "Finish"}),
    ],
)
def test_scripted_job_of_each_environment_scores_every_trajectory_1(
    sandbox_image: str, loom_up: LoomUp, tmp_path: Path, env: str, source: dict[str, Any], tools: set[str]
) -> None:
    job_id = _submit(loom_up, tmp_path, {"env": env, **source, "group_size": 2, "scripted": True})
    job = loom_up.wait_job(job_id, timeout=300)
    assert job["state"] == "completed" and job["completed"] == 6 and job["failed"] == 0, job
    trajs = _results(loom_up, tmp_path, job_id)
    assert len(trajs) == 6
    for t in trajs:
        assert t["status"] == "completed" and t["finish_reason"] == "done", t
        assert t["reward"] == 1.0, t["info"]
        assert t["env"] == env and t["steps"] and all(s["observation"] for s in t["steps"])
        assert all(s["output_len"] > 0 and s["prompt_len"] > 0 for s in t["steps"])
        # Tools ran in Docker containers, not the process fallback.
        assert t["info"]["sandbox"] == ("docker" if env in ("code", "math") else "none")
    used = {actions.parse(s["action"]).name for t in trajs for s in t["steps"]}
    assert used == tools


def test_redundant_rollouts_keep_group_size_samples_per_group(
    sandbox_image: str, loom_up: LoomUp, tmp_path: Path
) -> None:
    spec = {
        "env": "code",
        "dataset": {"name": "humaneval", "offset": 10, "limit": 2},
        "group_size": 2,
        "redundancy": 2,
        "scripted": True,
    }
    job_id = _submit(loom_up, tmp_path, spec)
    job = loom_up.wait_job(job_id, timeout=300)
    assert job["state"] == "completed" and job["n_trajectories"] == 8, job
    trajs = _results(loom_up, tmp_path, job_id)
    for g in (0, 1):
        group = [t for t in trajs if t["group"] == g]
        kept = [t for t in group if t["status"] == "completed"]
        dropped = [t for t in group if t["status"] == "aborted"]
        assert len(kept) == 2 and all(t["reward"] == 1.0 for t in kept), group
        assert len(dropped) == 2 and all(t["finish_reason"].startswith("redundant") for t in dropped)


def test_failed_environments_end_only_their_own_trajectories(
    sandbox_image: str, loom_up: LoomUp, tmp_path: Path
) -> None:
    # Unscripted on the simulated engine, whose results carry no text: each trajectory of this job ends,
    # failed, with the reason; a scripted job running beside it is untouched.
    bad = _submit(
        loom_up, tmp_path, {"env": "code", "dataset": {"name": "humaneval", "limit": 2}, "group_size": 2}
    )
    good = _submit(
        loom_up,
        tmp_path,
        {
            "env": "math",
            "dataset": {"name": "gsm8k", "offset": 5, "limit": 2},
            "group_size": 2,
            "scripted": True,
            "env_concurrency": 1,
        },
    )
    jb, jg = loom_up.wait_job(bad, timeout=300), loom_up.wait_job(good, timeout=300)
    assert jb["failed"] == 4 and jb["completed"] == 0, jb
    assert jg["completed"] == 4 and jg["failed"] == 0, jg
    for t in _results(loom_up, tmp_path, bad):
        assert t["status"] == "failed" and "scripted" in t["finish_reason"] and t["reward"] is None
    assert all(t["reward"] == 1.0 for t in _results(loom_up, tmp_path, good))

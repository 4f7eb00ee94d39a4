"""A job through `loom up` served by a rollout worker with LOOM_ROLLOUT_ENGINE=vllm, against `loom sim-server
--api vllm` (vLLM's HTTP API over the simulated engine): the job completes, and the server saw Loom's
priorities, an abort and a fleet weight update.

`loom up` takes the rollout settings' own variables (or `--engine vllm --engine-url URL`)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom_cli.deploy import free_port, gather_health
from tests.conftest import need_shared
from tests.e2e.conftest import LOOM, LoomUp, start_loom_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SPEED = "50"
CONTEXT = "40960"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "sim-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # Qwen3-8B's own context length, far below the KV cache's as on a real server.
            [
                LOOM,
                "sim-server",
                "--api",
                "vllm",
                "--port",
                str(port),
                "--speed",
                SPEED,
                "--max-model-len",
                CONTEXT,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # vLLM's readiness probe
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def loom_vllm(tmp_path_factory: pytest.TempPathFactory, vllm_url: str) -> Iterator[LoomUp]:
    """`LOOM_ROLLOUT_ENGINE=vllm LOOM_ROLLOUT_VLLM_URL=... loom up`: its rollout worker drives the server."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    base = tmp_path_factory.mktemp("loom")
    env = {"LOOM_ROLLOUT_ENGINE": "vllm", "LOOM_ROLLOUT_VLLM_URL": vllm_url}
    up_run = start_loom_up(base, "--workers", "1", env=env)
    up = next(up_run)
    try:
        deadline = time.monotonic() + 60
        while not _serving(up, "w0"):
            assert time.monotonic() < deadline, "the vLLM worker never answered"
            time.sleep(0.5)
        yield up
    finally:
        # Resumed to its end: it stops `loom up`, then checks that no user was refused.
        for _ in up_run:
            pass


def _serving(up: LoomUp, worker_id: str) -> bool:
    """Whether the rollout worker answers health checks, on the vLLM engine."""
    health = asyncio.run(gather_health(str(up.state()["nats_url"]), 0.5, up.home))
    return any(
        h.details.get("worker_id") == worker_id and h.details.get("engine") == "vllm"
        for h in health["rollout"]
    )


def _received(url: str) -> dict[str, Any]:
    return httpx.get(url + "/loom/received").json()  # type: ignore[no-any-return]


def test_a_job_runs_on_vllm_with_priorities_an_abort_and_a_weight_update(
    loom_vllm: LoomUp, vllm_url: str, tmp_path: Path
) -> None:
    up = loom_vllm
    api = httpx.Client(base_url=up.api, headers=up.auth, timeout=60)
    job_id = up.submit(tmp_path, {"dataset": {"name": "swe-replay", "limit": 2}, "group_size": 2})
    # Replies of 20,000 tokens (the simulator has no end of sequence): seconds on the engine at this speed.
    long = {
        "env": "coin",
        "dataset": {"limit": 2},
        "group_size": 2,
        "max_turns": 1,
        "max_turn_tokens": 20_000,
    }
    doomed = up.submit(tmp_path, long)
    deadline = time.monotonic() + 60
    while sum(r.startswith(f"{doomed}.") for r in _received(vllm_url)["requests"]) < 4:
        assert time.monotonic() < deadline, _received(vllm_url)
        time.sleep(0.2)
    # The fleet (this one worker) moves to a checkpoint with requests running: pause, reload, label, resume.
    ckpt = tmp_path / "ckpt-1"
    ckpt.mkdir()
    moved = api.post("/v1/models/qwen3-8b/weights", json={"version": 1, "path": str(ckpt)})
    assert moved.status_code == 200, moved.text
    # The long job is cancelled mid-flight: its requests running on the engine are aborted there.
    assert up.cli("cancel", doomed).returncode == 0
    job = up.wait_job(job_id, timeout=240)
    assert job["state"] == "completed" and job["completed"] == 4 and job["failed"] == 0, job

    received = _received(vllm_url)
    # Loom's priorities, larger first, reach vLLM negated (lower first).
    assert any(p < 0 for p in received["priorities"]), received["priorities"][:20]
    aborted = received["aborted"]
    assert aborted and all(r.startswith(f"cmpl-{doomed}.") for r in aborted), aborted
    assert received["pauses"] == ["keep"] and received["resumes"] >= 1
    assert (received["reloads"], received["versions"], received["cache_resets"]) == (
        [str(ckpt)],
        ["1"],
        [True],
    )
    assert httpx.get(vllm_url + "/weight_info").json() == {"weight_version": "1"}
    assert api.get("/v1/models/qwen3-8b/weights").json()["version"] == "1"
    out = tmp_path / "results.ndjson"
    assert up.cli("results", job_id, "-o", str(out)).returncode == 0
    versions = {
        s["weight_version"] for t in map(json.loads, out.read_text().splitlines()) for s in t["steps"]
    }
    assert "1" in versions, versions  # steps after the update carry the version vLLM labelled them with


def test_scripted_replies_are_scored_by_vllm(loom_vllm: LoomUp, vllm_url: str, tmp_path: Path) -> None:
    """A scripted job's replies are forced through the engine: vLLM scores them as prompt log-probs."""
    pytest.importorskip("reasoning_gym")
    scored = _received(vllm_url)["scored"]
    spec = {
        "env": "reasoning_gym:basic_arithmetic",
        "dataset": {"limit": 2},
        "group_size": 2,
        "scripted": True,
    }
    job_id = loom_vllm.submit(tmp_path, spec)
    job = loom_vllm.wait_job(job_id, timeout=120)
    assert job["state"] == "completed" and job["completed"] == 4 and job["failed"] == 0, job
    out = tmp_path / "results.ndjson"
    assert loom_vllm.cli("results", job_id, "-o", str(out)).returncode == 0
    for t in map(json.loads, out.read_text().splitlines()):
        assert t["reward"] > 0, t["info"]
        (step,) = t["steps"]
        assert step["output_ids"] and len(step["output_logprobs"]) == len(step["output_ids"]), step
        assert all(lp <= 0 for lp in step["output_logprobs"])
    assert _received(vllm_url)["scored"] == scored + 4


def test_the_context_limit_refuses_a_budget_and_ends_a_trajectory(
    loom_vllm: LoomUp, vllm_url: str, tmp_path: Path
) -> None:
    """Loom reads vLLM's max_model_len: a job whose budget cannot fit is refused at submission, and a trajectory
    whose context fills up ends with its own reason rather than a call vLLM refuses."""
    api = httpx.Client(base_url=loom_vllm.api, headers=loom_vllm.auth, timeout=60)
    refused = api.post("/v1/jobs", json={"env": "coin", "dataset": {"limit": 1}, "max_tokens": 50_000})
    assert refused.status_code == 422, refused.text
    (detail,) = refused.json()["detail"]
    assert detail["loc"] == ["body", "max_tokens"] and "40960-token context" in detail["msg"], detail
    # A recorded SWE-bench run whose context grows to 87,133 tokens, replayed as it was: its calls are cut to
    # the room left, and it ends when none is left, never with a call vLLM refuses.
    run = "django__django-11138"
    task = {"id": run, "data": {"trace_id": run, "siblings": "replay"}}
    job_id = loom_vllm.submit(tmp_path, {"tasks": [task], "group_size": 2})
    job = loom_vllm.wait_job(job_id, timeout=180)
    assert job["state"] == "completed" and job["completed"] == 2, job
    for t in loom_vllm.results(tmp_path, job_id):
        assert t["finish_reason"] == "max_context", t["finish_reason"]
        lengths = [(s["prompt_len"], s["output_len"]) for s in t["steps"]]
        assert all(p + o <= int(CONTEXT) for p, o in lengths), lengths

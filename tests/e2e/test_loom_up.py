"""End to end through `loom up` and the CLI, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import msgspec
import nats
import pytest

from loom.identity import nats_auth
from loom.protocol import DeadLetter, decode, subjects
from tests.e2e.conftest import LOOM, LoomUp, outlive, start_loom_up


def test_status_reports_every_service(loom_up: LoomUp) -> None:
    r = loom_up.cli("status")
    assert r.returncode == 0, r.stdout + r.stderr
    for svc in subjects.SERVICES:
        assert svc in r.stdout
    assert "NATS refused: publish 0, subscribe 0" in r.stdout


def test_router_kill9_job_completes_exactly_once(loom_up: LoomUp, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = {"dataset": {"name": "swe-replay", "offset": 10, "limit": 3}, "group_size": 4}
    job_id = loom_up.submit(tmp_path, spec)
    time.sleep(1.5)  # trajectories are mid-flight
    assert loom_up.job(job_id)["state"] == "running"
    loom_up.kill9("router")
    _assert_exactly_once(loom_up, tmp_path, job_id, 12)


def test_envmgr_and_reward_kill9_job_completes_exactly_once(loom_up: LoomUp, tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = {"dataset": {"name": "swe-replay", "offset": 20, "limit": 2}, "group_size": 4}
    job_id = loom_up.submit(tmp_path, spec)
    time.sleep(1.5)
    loom_up.kill9("envmgr")  # its trajectories are redelivered and replayed (engines return cached steps)
    time.sleep(1.0)
    loom_up.kill9("reward")
    _assert_exactly_once(loom_up, tmp_path, job_id, 8)


def _assert_exactly_once(up: LoomUp, tmp_path, job_id: str, n: int) -> None:  # type: ignore[no-untyped-def]
    job = up.wait_job(job_id)
    assert job["state"] == "completed" and job["completed"] == n and job["failed"] == 0, job
    out = tmp_path / "results.ndjson"
    r = up.cli("results", job_id, "-o", str(out))
    assert r.returncode == 0, r.stderr
    trajs = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [t["traj_id"] for t in trajs]
    assert len(ids) == n and len(set(ids)) == n
    assert all(t["status"] == "completed" and t["reward"] in (0.0, 1.0) and t["steps"] for t in trajs)


def test_a_jobs_results_replay_as_a_rollout_trace(loom_up: LoomUp, tmp_path: Path) -> None:
    """A Loom run becomes a replayable workload: `loom results --format trace` writes the schema, `loom trace
    check` reads it, and `loom bench rollout --workload` replays it, its groups and lengths as recorded."""
    spec = {"dataset": {"name": "swe-replay", "offset": 30, "limit": 3}, "group_size": 3}
    job_id = loom_up.submit(tmp_path, spec)
    assert loom_up.wait_job(job_id)["state"] == "completed"
    stored = loom_up.results(tmp_path, job_id)
    path = tmp_path / "run.jsonl"
    r = loom_up.cli("results", job_id, "--format", "trace", "-o", str(path))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 9 and {x["id"] for x in lines} == {t["traj_id"] for t in stored}
    by_id = {t["traj_id"]: t for t in stored}
    for x in lines:
        steps = by_id[x["id"]]["steps"]
        assert [(t["context_tokens"], t["output_tokens"]) for t in x["turns"]] == [
            (s["prompt_len"], s["output_len"]) for s in steps
        ]
        assert {t["finish_reason"] for t in x["turns"]} <= {"stop", "length"}
    check = loom_up.cli("trace", "check", str(path))
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout)["steps"] == {"0": {"trajectories": 9, "groups": 3}}
    bench = loom_up.cli(
        "bench",
        "rollout",
        "--workload",
        str(path),
        "--predictor",
        "oracle",
        "--gpus",
        "8",
        "--json",
        timeout=120,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    out = json.loads(bench.stdout.strip().splitlines()[-1])
    assert out["trajectories"] == 9 and out["file"]["groups"] == 3 and out["file"]["turns_without_env_s"] == 0
    assert out["output_tokens"] == sum(s["output_len"] for t in stored for s in t["steps"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().replace('"output_tokens":', '"output_tokens":-', 1))
    r = loom_up.cli("bench", "rollout", "--workload", str(bad), "--predictor", "oracle")
    assert (
        r.returncode != 0
        and f"--workload: {bad}:1: Expected `int` >= 0 - at `$.turns[0].output_tokens`" in r.stderr
    )


def test_rest_rejects_bad_input_with_named_fields(loom_up: LoomUp) -> None:
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    cases = [
        ({"group_size": 0, "dataset": {"name": "swe-replay"}}, ["body", "group_size"]),
        ({"dataset": {"name": "nope"}}, ["body", "dataset", "name"]),
        (
            {"tasks": [{"id": "x", "data": {"trace_id": "not-a-trace"}}]},
            ["body", "tasks", 0, "data", "trace_id"],
        ),
        ({"colour": "red"}, ["body"]),
        ({}, ["body", "tasks"]),
    ]
    for body, loc in cases:
        r = api.post("/v1/jobs", json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["detail"][0]["loc"] == loc, r.text
    r = api.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "invalid JSON" in r.text
    for method, path in (("GET", "/v1/jobs/job-missing"), ("DELETE", "/v1/jobs/job-missing")):
        r = api.request(method, path)
        assert r.status_code == 404 and "job-missing" in r.json()["detail"]
    assert api.get("/v1/jobs/x/trajectories", params={"limit": 0}).status_code == 422
    assert "/v1/jobs" in api.get("/openapi.json").json()["paths"]
    assert api.get("/healthz").json()["ok"] is True
    assert "loom_scheduler_jobs_submitted_total" in api.get("/metrics").text


async def test_nats_bad_input_is_answered_and_kept(loom_up: LoomUp) -> None:
    """Garbage from a peer allowed to send there (each subject as a role that may publish to it)."""
    nc = await loom_up.connect("envmgr")
    scheduler = await loom_up.connect("scheduler")
    operator = await loom_up.connect(nats_auth.OPERATOR)
    js = nc.jetstream()
    try:
        for subj in (subjects.PREDICT, subjects.GEN_REQUEST):
            reply = await nc.request(subj, b"\x93garbage", timeout=3)
            assert b"bad_request" in reply.data
        before = (await js.stream_info(subjects.STREAM_DLQ)).state.messages
        await scheduler.jetstream().publish(subjects.traj_work("job-bogus"), b"not a trajectory")
        await js.publish(
            subjects.reward_submit("default", "job-bogus"), msgspec.msgpack.encode({"trajectory": 1})
        )
        for _ in range(50):
            info = await js.stream_info(subjects.STREAM_DLQ)
            if info.state.messages >= before + 2:
                break
            await asyncio.sleep(0.1)
        letters = [
            decode((await js.get_msg(subjects.STREAM_DLQ, seq=s)).data or b"", DeadLetter)
            for s in range(info.state.first_seq, info.state.last_seq + 1)
        ]
        assert {d.service for d in letters} >= {"envmgr", "reward", "predictor", "router"}
        # Nothing crashed: work queues are empty (bad messages terminated, not redelivered forever).
        assert (await js.stream_info(subjects.STREAM_TRAJWORK)).state.messages == 0
        for svc in subjects.SERVICES:
            text = (await operator.request(subjects.metrics(svc), b"", timeout=3)).data.decode()
            assert f"loom_{svc}_bad_messages_total" in text
    finally:
        for c in (nc, scheduler, operator):
            await c.close()
    assert loom_up.cli("status").returncode == 0


async def test_nats_admits_no_stranger(loom_up: LoomUp) -> None:
    """Finding 2 on the running system: no anonymous client connects."""
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        await nats.connect(str(loom_up.state()["nats_url"]), max_reconnect_attempts=0, allow_reconnect=False)


def test_cancel_stops_a_running_job(loom_up: LoomUp, tmp_path) -> None:  # type: ignore[no-untyped-def]
    job_id = loom_up.submit(tmp_path, {"dataset": {"name": "swe-replay", "limit": 8}, "group_size": 8})
    time.sleep(1.0)
    r = loom_up.cli("cancel", job_id)
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "cancelled"
    job = loom_up.job(job_id)
    assert job["state"] == "cancelled" and job["completed"] < 64
    # The environment manager stops every trajectory and both engines abort their requests: polled, not
    # slept on (a loaded machine once took longer than a fixed 2 s to report it).
    deadline = time.monotonic() + 20
    while True:
        r = loom_up.cli("status")
        if '"active": 0' in r.stdout and r.stdout.count('"running": 0') == 2:
            break
        assert time.monotonic() < deadline, r.stdout
        time.sleep(0.5)
    assert loom_up.cli("cancel", "job-missing").returncode == 2


def test_schemathesis_finds_nothing_against_the_running_api(loom_up: LoomUp, tmp_path: Path) -> None:
    """Every check and every phase, stateful included, against the documented API with the admin token.
    Last but one: the jobs it submits keep the workers busy. (Its first run found a stream of 100,000 groups
    that made the scheduler unresponsive: streams now keep a bounded number in flight.)"""
    token = (loom_up.home / "api_token").read_text().strip()
    cmd = [
        str(Path(LOOM).parent / "schemathesis"),
        "--config-file",
        str(Path(__file__).parent / "schemathesis.toml"),
    ]
    cmd += ["run", f"{loom_up.api}/openapi.json", "-H", f"Authorization: Bearer {token}", "--checks", "all"]
    cmd += ["--max-examples", "30", "--request-timeout", "10", "--seed", "1"]
    # Into a file, not a pipe: a process schemathesis leaves behind would hold a pipe open after it exits.
    log = tmp_path / "schemathesis.log"
    with log.open("w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=280, check=False)
    out = log.read_text()
    assert r.returncode == 0, out[-6000:]
    assert "passed" in out and "failures" not in out.rsplit("Test cases:", 1)[-1]


def test_ctrl_c_stops_everything(loom_up: LoomUp) -> None:
    pids = list(loom_up.state()["pids"].values())
    loom_up.proc.send_signal(signal.SIGINT)
    assert loom_up.proc.wait(60) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (loom_up.home / "state.json").exists()


def _children(up: LoomUp) -> list[int]:
    state = up.state()
    return [*state["pids"].values(), *state["nats_pids"]]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_sigterm_or_sigkill_to_loom_up_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """Job schedulers and `timeout` stop with SIGTERM, which must clean up as Ctrl-C does; a `loom up` killed
    outright still takes nats-server and every service with it (they used to run on, orphaned)."""
    gen = start_loom_up(tmp_path)
    up = next(gen)
    pids = _children(up)
    # With GEM's virtualenv built, `loom up` also runs GEM's environment manager.
    assert len(pids) == 8 + ("envmgr-gem" in up.state()["pids"]) and all(pids)
    up.proc.send_signal(sig)
    assert up.proc.wait(30) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert outlive(pids, 25) == []
    gen.close()

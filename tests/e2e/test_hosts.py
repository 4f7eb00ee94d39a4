"""Loom over two hosts (network namespaces with their own addresses; NATS on a third, the root namespace):
each host runs a scheduler, a router, a predictor, an environment manager, a reward worker and a rollout
worker. One host is lost mid-job, every process in it killed at once: the job completes on the other, each
trajectory's result exactly once."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loom.identity import nats_auth
from loom.identity.auth import header
from loom.runtime.natsserver import NatsServer
from loom_cli.deploy import DeployConfig, Deployment, free_port, gather_health
from tests.conftest import need_shared
from tests.e2e import hosts
from tests.e2e.hosts import CONTROL, Host, Hosts

pytestmark = pytest.mark.timeout(400)
# Which host runs what; the second also runs its own predictor, environment manager and reward worker.
PLACES = {
    "scheduler": 0,
    "router": 0,
    "predictor": 0,
    "envmgr": 0,
    "reward": 0,
    "rollout-w0": 0,
    "scheduler-2": 1,
    "router-2": 1,
    "rollout-w1": 1,
}
DOUBLED = ("predictor", "envmgr", "reward")


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    why = hosts.missing()
    if why:
        pytest.skip(why)
    made = Hosts(2)
    try:
        yield made.hosts
    finally:
        made.close()


def test_a_host_lost_mid_job_loses_no_trajectory(two_hosts: list[Host], tmp_path: Path) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    asyncio.run(_run(two_hosts, tmp_path))


async def _run(two: list[Host], tmp_path: Path) -> None:
    home = tmp_path / "home"
    ports = [free_port(), free_port()]
    dep = Deployment(
        DeployConfig(home=home, workers=2, speed=50.0, api_port=ports[0], schedulers=2, routers=2)
    )
    server = NatsServer(home / "nats", host="0.0.0.0", authorization=nats_auth.authorization(dep.passwords))
    await server.start()
    local = server.url
    server.url = f"nats://{CONTROL}:{server.port}"  # what the hosts dial
    dep.nats, dep.standby_ports = server, ports[1:]
    logs = tmp_path / "logs"
    logs.mkdir()
    apis = []
    try:
        specs = {s.name: s for s in dep.service_specs()}
        placed = [(name, PLACES[name]) for name in specs] + [(name, 1) for name in DOUBLED]
        for name, i in placed:
            spec, host = specs[name], two[i]
            env = {**os.environ, **spec.env, "LOOM_ENVMGR_ACK_WAIT_S": "5", "LOOM_REWARD_ACK_WAIT_S": "5"}
            if name.startswith("scheduler"):
                port = env["LOOM_SCHEDULER_PORT"]
                env["LOOM_SCHEDULER_HOST"] = "0.0.0.0"
                env["LOOM_SCHEDULER_ADVERTISE"] = f"http://{host.address}:{port}"
                apis.append(f"http://{host.address}:{port}")
            host.run(spec.argv, env, logs / f"{name}-{host.name}.log")
        want = {"scheduler": 2, "router": 2, "predictor": 2, "envmgr": 2, "reward": 2, "rollout": 2}
        deadline = time.monotonic() + 90
        while True:
            health = await gather_health(local, 0.5, home)
            if all(len(health.get(s, [])) >= n for s, n in want.items()):
                break
            assert time.monotonic() < deadline, {s: len(h) for s, h in health.items()}
            await asyncio.sleep(0.5)

        auth = header(dep.api_token)
        async with httpx.AsyncClient(headers=auth, timeout=30) as http:
            spec = {"dataset": {"name": "swe-replay", "offset": 50, "limit": 3}, "group_size": 4}
            r = await http.post(f"{apis[0]}/v1/jobs", json=spec)
            assert r.status_code == 201, r.text
            job_id = r.json()["id"]
            await asyncio.sleep(2.0)
            assert (await http.get(f"{apis[1]}/v1/jobs/{job_id}")).json()["state"] == "running"
            assert two[0].kill() >= len([p for p in placed if p[1] == 0])  # the host and everything on it

            deadline = time.monotonic() + 240
            while True:
                r = await http.get(f"{apis[1]}/v1/jobs/{job_id}")
                if r.status_code == 200 and r.json()["state"] in ("completed", "failed", "cancelled"):
                    break
                assert time.monotonic() < deadline, r.text
                await asyncio.sleep(1.0)
            job = r.json()
            assert job["state"] == "completed" and job["completed"] == 12 and job["failed"] == 0, job
            r = await http.get(f"{apis[1]}/v1/jobs/{job_id}/trajectories", params={"format": "ndjson"})
            ids = [json.loads(line)["traj_id"] for line in r.text.splitlines() if line.strip()]
            assert len(ids) == 12 and len(set(ids)) == 12
    finally:
        for h in two:
            h.kill()
        await server.stop()
    refused = [
        line for line in (home / "nats" / "nats-server.log").read_text().splitlines() if "Violation" in line
    ]
    assert not refused, refused[:5]

"""Co-scheduled RL jobs through the scheduler service: REST registration and placement, phase permits over
NATS in round-robin order, warm-start hooks, long-tail migration, restart replay; and the demo's trainer
processes (separate OS processes) never overlapping phases the plan forbids."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest

from loom.protocol import TailMigration
from loom.trainer.phases import PhaseClient, PhaseError
from loom_cli.deploy import free_port
from loom_cli.rollmux_demo import DEMO_JOBS, check_timeline
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, AUTH, Services
from tests.integration.helpers import start_scheduler_api


async def _scheduler(services: Services, port: int) -> str:
    return await start_scheduler_api(services, SchedulerSettings(port=port, api_token=API_TOKEN))


async def test_register_permits_migration_and_restart(services: Services, nats_url: str) -> None:
    port = free_port()
    api = await _scheduler(services, port)
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        placed = []
        for spec in DEMO_JOBS:
            r = await http.post("/v1/rljobs", json=spec)
            assert r.status_code == 201, r.text
            placed.append(r.json())
        assert [p["strategy"] for p in placed] == ["isolated", "direct", "scaling"]
        assert {p["group"] for p in placed} == {0} and placed[2]["rollout_nodes"] == [1]
        assert (await http.post("/v1/rljobs", json=DEMO_JOBS[0])).status_code == 409
        bad = await http.post("/v1/rljobs", json={**DEMO_JOBS[0], "name": "x", "model": "70b"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "model"]
        listing = (await http.get("/v1/rljobs")).json()
        assert listing["cost_per_hour"] == pytest.approx(71.84)  # solo: 3 x 57.04

    nc = await nats.connect(nats_url)
    events: list[Any] = []
    a = PhaseClient(
        nc,
        "agentic-7b",
        on_load=lambda phase, permit: events.append(("load", phase, permit.gpus)),
        on_offload=lambda phase: events.append(("offload", phase)),
        on_migrate=lambda m: events.append(m),
    )
    b = PhaseClient(nc, "rlhf-7b")
    for c in (a, b):
        await c.start()
    try:
        async with a.phase("rollout") as permit:
            assert permit.nodes == [0] and permit.gpus == {0: 8}
            waiting = asyncio.create_task(b.acquire("rollout", timeout_s=5))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # node 0 is agentic's until its tail is migrated
            await a.progress(0.85)
            second = await waiting
            assert second.gpus == {0: 6}
            assert isinstance(events[-1], TailMigration) and events[-1].gpus == 2
        assert events[0] == ("load", "rollout", {0: 8}) and events[-1] == ("offload", "rollout")
        await b.release("rollout")
        with pytest.raises(PhaseError, match="conflict"):
            await b.release("rollout")
        with pytest.raises(PhaseError, match="not_found"):
            await PhaseClient(nc, "ghost")._ask("loom.v1.rollmux.request", {"job": "ghost", "phase": "train"})
    finally:
        for c in (a, b):
            await c.close()
        await nc.close()

    await services.stop("scheduler")  # registrations survive a restart, replayed into the same plan
    api = await _scheduler(services, port)
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        again = (await http.get("/v1/rljobs")).json()
        assert [(j["job"], j["group"], j["rollout_nodes"]) for j in again["jobs"]] == [
            (p["job"], p["group"], p["rollout_nodes"]) for p in placed
        ]
        assert (await http.delete("/v1/rljobs/math-7b")).status_code == 200
        assert (await http.get("/v1/rljobs/math-7b")).status_code == 404
        assert (await http.get("/v1/rljobs")).json()["cost_per_hour"] == pytest.approx(57.04)


def test_demo_trainer_processes_follow_the_permits(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "loom_cli.main",
            "rollmux-demo",
            "--time-scale",
            "0.004",
            "--iterations",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["violations"] == [] and out["trainer_exit_codes"] == [0, 0, 0]
    assert out["phases_run"] == 18 and out["overlaps_from_migration"] >= 1
    assert Path(out["gantt"]).stat().st_size > 0
    # The checker itself catches a forbidden overlap.
    base = {"group": 0, "nodes": [-1], "gpus": {}, "phase": "train"}
    bad, _ = check_timeline(
        [{**base, "job": "a", "start": 0, "end": 2}, {**base, "job": "b", "start": 1, "end": 3}]
    )
    assert bad

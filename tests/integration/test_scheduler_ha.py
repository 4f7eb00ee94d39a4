"""Two schedulers, one active through the lease: the standby's REST API forwards to the active one, and when
the active one dies (no drain, as under kill -9) the standby takes over within the lease's ttl with every job
intact, its API answering throughout with nothing worse than the takeover window's 503s."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from loom_cli.deploy import free_port
from services.scheduler.__main__ import Scheduler
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, AUTH, Services, need_shared

TTL = 2.0


async def _start(services: Services, key: str) -> tuple[str, Scheduler]:
    settings = SchedulerSettings(port=free_port(), api_token=API_TOKEN, instance=key)
    holder: list[Scheduler] = []

    def build(rt):  # type: ignore[no-untyped-def]
        holder.append(Scheduler(rt, settings))
        return holder[0]

    await services.start(key, "scheduler", settings, build)
    api = f"http://127.0.0.1:{settings.port}"
    async with httpx.AsyncClient(headers=AUTH) as http:
        for _ in range(200):
            try:
                if (await http.get(f"{api}/v1/jobs")).status_code == 200:
                    return api, holder[0]
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"scheduler {key}'s API did not answer")


async def test_the_standby_forwards_then_takes_over_with_every_job(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    monkeypatch.setenv("LOOM_LEASE_TTL_S", str(TTL))
    first, a = await _start(services, "s-a")
    second, b = await _start(services, "s-b")
    assert a.role is not None and b.role is not None and a.role.active and not b.role.active
    job = {"dataset": {"name": "swe-replay", "limit": 2}, "group_size": 2}
    async with httpx.AsyncClient(headers=AUTH, timeout=10) as http:
        # Submitted to the standby, made by the active one: both list it.
        made = await http.post(f"{second}/v1/jobs", json=job)
        assert made.status_code == 201, made.text
        job_id = made.json()["id"]
        for api in (first, second):
            assert [j["id"] for j in (await http.get(f"{api}/v1/jobs")).json()["jobs"]] == [job_id]
        assert (await http.get(f"{second}/v1/jobs/nope")).status_code == 404  # the active one's answer
        assert (await http.get(f"{second}/v1/jobs", headers={"authorization": "Bearer x"})).status_code == 401

        # The active one dies without a word; the standby's API answers all along.
        await services.crash("s-a")
        died = time.monotonic()
        codes: list[int] = []
        while not b.role.active:
            codes.append((await http.get(f"{second}/v1/jobs")).status_code)
            assert time.monotonic() - died < TTL + 3, "no takeover"
            await asyncio.sleep(0.1)
        took = time.monotonic() - died
        assert took < TTL + 2.0 and set(codes) <= {200, 503}, (took, codes)
        r = await http.get(f"{second}/v1/jobs/{job_id}")
        assert r.status_code == 200 and r.json()["id"] == job_id
        health = b.health()
        assert health["role"] == "active" and health["api"] == second

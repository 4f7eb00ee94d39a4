"""The REST edge lets in no one without a token, shows each tenant only its own jobs and streams, and no
single request hurts everyone (a real scheduler on a real nats-server; tokens from a file and settings)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from nats.aio.client import Client as NATS

from loom.identity.auth import AuthConfigError, header
from loom.protocol import CancelJob, encode, subjects
from loom_cli.deploy import free_port
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, AUTH, Services, need_shared
from tests.integration.helpers import start_scheduler_api, start_worker

TEAM_A, TEAM_B = "team-a-token-0123456789", "team-b-token-0123456789"


async def _up(services: Services, tmp_path: Path, **extra: object) -> str:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tenants": {"team-a": [TEAM_A], "team-b": [TEAM_B]}}))
    port = free_port()
    settings = SchedulerSettings(port=port, api_token=API_TOKEN, tokens_file=tokens, **extra)
    return await start_scheduler_api(services, settings)


async def test_no_token_no_entry_and_tenants_see_only_their_own(services: Services, tmp_path: Path) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    api = await _up(services, tmp_path)
    job = {"dataset": {"name": "swe-replay", "limit": 1}, "group_size": 2}
    async with httpx.AsyncClient(base_url=api) as http:
        # Finding 1: nothing answers without a valid token, the docs and metrics included.
        for path in ("/v1/jobs", "/docs", "/openapi.json", "/metrics", "/healthz", "/v1/streams"):
            r = await http.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert (await http.get(path, headers=header("not-a-token-at-all-x"))).status_code == 401
        assert (await http.post("/v1/jobs", json=job)).status_code == 401
        assert (await http.get("/v1/jobs", headers={"Authorization": f"Basic {TEAM_A}"})).status_code == 401

        r = await http.post("/v1/jobs", json=job, headers=header(TEAM_A))
        assert r.status_code == 201, r.text
        mine = r.json()
        assert mine["spec"]["tenant"] == "team-a"
        # A tenant cannot submit in another's name; the admin can.
        forged = await http.post("/v1/jobs", json={**job, "tenant": "team-b"}, headers=header(TEAM_A))
        assert forged.status_code == 403
        theirs = await http.post("/v1/jobs", json={**job, "tenant": "team-b"}, headers=AUTH)
        assert theirs.status_code == 201 and theirs.json()["spec"]["tenant"] == "team-b"

        # Cross-tenant reads and cancels find nothing; the owner and the admin find the job.
        for method, path in (
            ("GET", f"/v1/jobs/{mine['id']}"),
            ("GET", f"/v1/jobs/{mine['id']}/trajectories"),
            ("DELETE", f"/v1/jobs/{mine['id']}"),
        ):
            assert (await http.request(method, path, headers=header(TEAM_B))).status_code == 404
        listed_b = (await http.get("/v1/jobs", headers=header(TEAM_B))).json()["jobs"]
        assert [j["id"] for j in listed_b] == [theirs.json()["id"]]
        listed_admin = (await http.get("/v1/jobs", headers=AUTH)).json()["jobs"]
        assert {j["id"] for j in listed_admin} == {mine["id"], theirs.json()["id"]}
        assert (await http.get(f"/v1/jobs/{mine['id']}", headers=header(TEAM_A))).status_code == 200
        assert (await http.delete(f"/v1/jobs/{mine['id']}", headers=AUTH)).json()["state"] == "cancelled"

        # Co-scheduling places jobs on the shared cluster: the admin's alone.
        assert (await http.get("/v1/rljobs", headers=header(TEAM_A))).status_code == 403
        assert (await http.get("/v1/rljobs", headers=AUTH)).status_code == 200

        # Each refusal is counted by reason.
        metrics = (await http.get("/metrics", headers=AUTH)).text
        counts = {
            line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("loom_scheduler_auth_refused_total{")
        }
        assert counts == {"no_token": 8.0, "wrong_token": 6.0}


async def test_a_tenants_quota_counts_its_streams_and_its_jobs(services: Services, tmp_path: Path) -> None:
    """A stream holds up to its open groups' samples in flight: they count against the tenant's quota as a
    job's trajectories do, and the quota comes back when the stream ends."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    api = await _up(services, tmp_path, tenant_max_trajectories=100)
    data = {"dataset": {"name": "swe-replay", "limit": 4}, "group_size": 8}
    async with httpx.AsyncClient(base_url=api, headers=header(TEAM_A), timeout=30) as http:
        r = await http.post("/v1/streams", json={**data, "buffer_groups": 10})  # 80 in flight
        assert r.status_code == 201, r.text
        stream = r.json()["id"]
        r = await http.post("/v1/jobs", json=data)  # 32 more
        assert r.status_code == 429 and "80 trajectories in flight" in r.json()["detail"]
        r = await http.post("/v1/streams", json={**data, "buffer_groups": 3})  # 24 more
        assert r.status_code == 429 and "quota of 100" in r.json()["detail"]
        # Another tenant's quota is its own.
        assert (await http.post("/v1/jobs", json=data, headers=header(TEAM_B))).status_code == 201
        assert (await http.delete(f"/v1/streams/{stream}")).status_code == 200
        assert (await http.post("/v1/jobs", json=data)).status_code == 201


def test_no_tokens_configured_is_refused_at_start(tmp_path: Path) -> None:
    from loom.identity.auth import Tokens

    with pytest.raises(AuthConfigError, match="no API token configured"):
        Tokens.load(None, None)
    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps({"tenants": {"team a": ["0123456789abcdefgh"]}}))
    with pytest.raises(AuthConfigError, match="bad tenant name"):
        Tokens.load(None, bad)
    bad.write_text(json.dumps({"tenants": {"a": ["short"]}}))
    with pytest.raises(AuthConfigError, match="at least 16"):
        Tokens.load(None, bad)
    bad.write_text("{not json")
    with pytest.raises(AuthConfigError, match="cannot read"):
        Tokens.load(API_TOKEN, bad)


async def test_no_single_request_hurts_everyone(services: Services, nc: NATS, tmp_path: Path) -> None:
    """Findings 2 (a cancel from the bus), 5 (deep nesting, huge bodies), 6 (a huge job blocking intake)."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    api = await _up(services, tmp_path, tenant_max_trajectories=30_000, max_body_mb=1.0)
    await start_worker(services, "w0")
    async with httpx.AsyncClient(base_url=api, headers=AUTH, timeout=30) as http:
        deep = (
            b'{"dataset": {"name": "swe-replay"}, "reward_params": {"x": ' + b"[" * 100_000 + b"]" * 100_000
        )
        r = await http.post("/v1/jobs", content=deep + b"}}", headers={"content-type": "application/json"})
        assert r.status_code in (413, 422), r.text
        shallow = b'{"dataset": {"name": "swe-replay"}, "reward_params": {"x": ' + b"[" * 5000 + b"]" * 5000
        r = await http.post("/v1/jobs", content=shallow + b"}}", headers={"content-type": "application/json"})
        assert r.status_code in (201, 422), r.text
        r = await http.post("/v1/jobs", content=b'{"tasks": [' + b'{"id": "x"},' * 200_000 + b'{"id": "y"}]}')
        assert r.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"tasks": []}'

        assert (await http.post("/v1/jobs", content=chunks())).status_code == 411
        small = {"dataset": {"name": "swe-replay", "limit": 1}}
        assert (await http.post("/v1/jobs", json=small)).status_code == 201

        huge = {"dataset": {"name": "swe-replay", "limit": 400}, "group_size": 1024}
        r = await http.post("/v1/jobs", json=huge)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "group_size"]
        # A stream keeps a bounded number of groups in flight (its record lists them all).
        for groups, size in ((100_000, 1), (2000, 64)):
            r = await http.post("/v1/streams", json={**huge, "group_size": size, "buffer_groups": groups})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "buffer_groups"]
        over = {"dataset": {"name": "swe-replay", "limit": 400}, "group_size": 80}
        assert (await http.post("/v1/jobs", json=over, headers=header(TEAM_A))).status_code == 429

        # 25,600 trajectories: the POST returns at once and other requests are answered while it launches.
        big = {"dataset": {"name": "swe-replay", "limit": 400}, "group_size": 64}
        clock = asyncio.get_running_loop().time
        t0 = clock()
        r = await http.post("/v1/jobs", json=big, headers=header(TEAM_A))
        assert r.status_code == 201 and clock() - t0 < 5.0
        job_id = r.json()["id"]
        t0 = clock()
        assert (await http.get("/v1/jobs", headers=header(TEAM_B))).status_code == 200
        assert (await http.post("/v1/jobs", json=small, headers=header(TEAM_B))).status_code == 201
        assert (await http.delete(f"/v1/jobs/{job_id}")).json()["state"] == "cancelled"
        assert clock() - t0 < 5.0
        js = nc.jetstream()
        for _ in range(300):
            info = await js.stream_info(subjects.STREAM_TRAJWORK, subjects_filter=subjects.traj_work(job_id))
            if not sum((info.state.subjects or {}).values()):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the cancelled job's queued work was not purged")

        # A cancel published on the bus ends the job's record as cancelled too.
        job_id = (await http.post("/v1/jobs", json=small)).json()["id"]
        await nc.publish(subjects.CONTROL_CANCEL, encode(CancelJob(job_id)))
        for _ in range(100):
            if (await http.get(f"/v1/jobs/{job_id}")).json()["state"] == "cancelled":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("a bus cancel left the job running")
        assert (await http.get("/healthz")).json()["ok"] is True


async def test_an_integer_the_bus_cannot_carry_is_a_422_naming_where(
    services: Services, tmp_path: Path
) -> None:
    """JSON has integers of any size and a task's data takes any; the bus's msgpack holds 64 bits. Such a body
    was a 500 (schemathesis found it): now it is refused where it is decoded, for jobs and streams alike."""
    api = await _up(services, tmp_path)

    def job(n: int) -> dict[str, object]:
        return {"env": "external", "tasks": [{"id": "t0"}, {"id": "t1", "data": {"x": [0, {"n": n}]}}]}

    async with httpx.AsyncClient(base_url=api, headers=AUTH, timeout=30) as http:
        for path in ("/v1/jobs", "/v1/streams"):
            for n in (10**36, 2**64, -(2**63) - 1):
                r = await http.post(path, json=job(n))
                assert r.status_code == 422, (path, n, r.text)
                (detail,) = r.json()["detail"]
                assert detail["loc"] == ["body", "tasks", 1, "data", "x", 1, "n"], detail
                assert detail["msg"] == "integer out of range (-2**63 to 2**64 - 1)"
        for n in (2**64 - 1, -(2**63)):
            r = await http.post("/v1/jobs", json=job(n))
            assert r.status_code == 201, r.text
        assert (await http.get("/healthz")).json()["ok"] is True


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref" and isinstance(v, str)] + [
            r for v in node.values() for r in _refs(v)
        ]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


async def test_openapi_document_resolves_and_names_every_answer(services: Services, tmp_path: Path) -> None:
    api = await _up(services, tmp_path)
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        doc = (await http.get("/openapi.json")).json()
    refs = _refs(doc)
    assert refs and all(r.startswith("#/components/schemas/") for r in refs)
    schemas = doc["components"]["schemas"]
    assert all(r.rsplit("/", 1)[1] in schemas for r in refs), sorted(set(refs) - set(schemas))
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "401" in op["responses"], (method, path)
    jobs = doc["paths"]["/v1/jobs"]["post"]
    assert jobs["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobSpec"
    }
    assert {"201", "401", "403", "411", "413", "422", "429"} <= set(jobs["responses"])
    assert {"404", "401"} <= set(doc["paths"]["/v1/jobs/{job_id}"]["delete"]["responses"])
    assert "503" in doc["paths"]["/healthz"]["get"]["responses"]
    stream = doc["paths"]["/v1/streams"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert stream == {"$ref": "#/components/schemas/StreamSpec"}


async def test_a_method_the_path_lacks_names_every_method_it_has(services: Services, tmp_path: Path) -> None:
    api = await _up(services, tmp_path)
    async with httpx.AsyncClient(base_url=api, headers=AUTH) as http:
        r = await http.put("/v1/jobs")
        assert r.status_code == 405 and r.headers["allow"] == "GET, POST", r.headers
        r = await http.post("/v1/jobs/x")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", r.headers

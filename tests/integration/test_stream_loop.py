"""Rollout streams over a real nats-server: scheduler, router, simulated rollout workers and the environment
manager in-process, the reward service as its own process; the trainer is the SDK.

- groups flow into the buffer and out to the trainer, the fleet moves versions together;
- the asynchronous bound aborts exactly the trajectories that violate it, and their groups are sampled again;
- crashing the scheduler, the router and a rollout worker mid-stream loses no group and delivers none twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from nats.aio.client import Client as NATS

from loom.integrations import fleet
from loom.protocol import Stream, StreamRef, StreamSpec, subjects, to_builtins
from loom.runtime import results
from loom.runtime.bus import BusError, request
from loom.runtime.service import Runtime
from loom.runtime.workers import read_workers
from loom.trainer.buffer import Batch, StreamClosed, StreamEnded
from loom.trainer.client import StreamClient
from loom.weights.collective import Sender
from loom.weights.publish import CollectiveTransport
from loom_cli.deploy import free_port
from services.envmgr.manager import EnvManager
from services.envmgr.settings import EnvmgrSettings
from services.scheduler import streams as streams_module
from services.scheduler.__main__ import Scheduler
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, AUTH, Services, need_shared
from tests.integration.helpers import start_router, start_worker, until

ROOT = Path(__file__).resolve().parents[2]
STALE = re.compile(r"stale: started at version (\d+), policy now at (\d+), bound (\d+)")


async def start_scheduler(services: Services, key: str = "scheduler", port: int = 0) -> Scheduler:
    holder: list[Scheduler] = []

    def build(rt: Runtime) -> Scheduler:
        s = Scheduler(rt, SchedulerSettings(port=port, api_token=API_TOKEN))
        holder.append(s)
        return s

    settings = SchedulerSettings(port=port, reconcile_s=0.2, api_token=API_TOKEN)
    await services.start(key, "scheduler", settings, build)
    # Its stream subjects are subscribed only once it holds the lease and has reloaded (Scheduler.run): a
    # request before then has no responder, which a slow machine (CI) met.
    await until(lambda: holder[0].role is not None and holder[0].role.active, within_s=10)
    return holder[0]


async def start_envmgr(services: Services, speed: float) -> None:
    def build(rt: Runtime) -> EnvManager:
        return EnvManager(rt, EnvmgrSettings(predict_timeout_s=0.05))

    await services.start("envmgr", "envmgr", EnvmgrSettings(speed=speed, keepalive_s=0.2), build)


@pytest.fixture
async def reward(nats_url: str) -> AsyncIterator[None]:
    env = dict(os.environ, LOOM_NATS_URL=nats_url, LOOM_INSTANCE="stream-reward")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.reward", cwd=ROOT, env=env)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def stack(services: Services, speed: float, workers: int = 2, port: int = 0) -> None:
    for i in range(workers):
        await start_worker(services, f"w{i}", max_running=16, speed=speed)
    await start_router(services)
    await start_envmgr(services, speed)
    await start_scheduler(services, port=port)


def spec(n_tasks: int, **kw: object) -> StreamSpec:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    base: dict[str, object] = {
        "dataset": {"name": "swe-replay", "limit": n_tasks},
        "group_size": 2,
        "max_turns": 3,
        "lease_s": 30.0,
    }
    return StreamSpec(**{**base, **kw})  # type: ignore[arg-type]


def check_bound(batch: Batch, alpha: int) -> None:
    assert all(s <= alpha for s in batch.staleness), batch.staleness
    for g in batch.groups:
        assert len(g.trajectories) == 2
        for t in g.trajectories:
            assert t.status == "completed" and t.start_version is not None
            assert t.start_version >= batch.version - alpha


async def test_groups_flow_and_the_fleet_updates_together(
    nc: NATS, services: Services, reward: None, tmp_path: Path
) -> None:
    await stack(services, speed=100.0)
    async with await StreamClient.create(nc, spec(6, buffer_groups=3, async_bound=1)) as stream:
        b0 = await stream.get_batch(2, timeout=60)
        assert b0.version == 0 and len(b0.groups) == 2
        check_bound(b0, 1)
        res = await stream.update_weights(1, None)
        assert res.version == 1 and res.workers == ["w0", "w1"]
        b1 = await stream.get_batch(2, timeout=60)
        check_bound(b1, 1)
        assert stream.stream.open.keys().isdisjoint({g.group for g in b0.groups + b1.groups})
        # A checkpoint one worker cannot load leaves every worker where it was.
        with pytest.raises(BusError, match="not loaded, fleet kept"):
            await stream.update_weights(2, str(tmp_path / "missing"))
        assert (await stream.refresh()).version == 1
        # Back-pressure: never more groups open than the buffer holds.
        await asyncio.sleep(1.0)
        assert len((await stream.refresh()).open) <= 3
    with pytest.raises(StreamClosed):
        await stream.buffer.take(1, 5)


async def test_the_bound_aborts_exactly_the_trajectories_that_violate_it(
    nc: NATS, services: Services, reward: None
) -> None:
    # Slow enough that groups are still running when the policy moves on.
    await stack(services, speed=4.0)
    alpha = 1
    async with await StreamClient.create(
        nc, spec(8, buffer_groups=6, async_bound=alpha, epochs=None)
    ) as stream:
        for version in range(1, 5):
            batch = await stream.get_batch(2, timeout=120)
            check_bound(batch, alpha)
            await stream.update_weights(version, None)
        js = nc.jetstream()
        stale = 0
        async for t in results.iter_results(js, stream.id):
            m = STALE.match(t.finish_reason)
            if t.status == "aborted" and m:
                start, now, bound = map(int, m.groups())
                assert t.start_version == start and bound == alpha
                assert start < now - alpha  # it violated the bound when it was aborted
                stale += 1
            elif t.status == "completed":
                assert t.start_version is not None
        st = await stream.refresh()
        assert stale > 0 and st.stale_groups > 0
        assert stale <= 2 * st.stale_groups + 2 * 6


async def test_groups_gone_stale_in_the_buffer_are_sampled_again_while_the_trainer_waits(
    nc: NATS, services: Services, reward: None
) -> None:
    """Every task of a finite stream started and finished, then the policy moved two versions on: every group
    in the buffer is stale. The trainer waiting for a batch must have them sampled again at once; holding
    them until a batch it can never complete (their tasks started, none left to start) waited for ever."""
    await stack(services, speed=100.0)
    async with await StreamClient.create(nc, spec(4, buffer_groups=4, async_bound=1)) as stream:
        for _ in range(600):
            st = await stream.refresh()
            if len(st.open) == 4 and all(g.buffered for g in st.open.values()):
                break
            await asyncio.sleep(0.1)
        assert all(g.buffered for g in st.open.values()) and st.next_pos == 4
        for version in (1, 2):
            await stream.update_weights(version, None)
        batch = await stream.get_batch(2, timeout=60)
        check_bound(batch, 1)
        assert batch.stale >= 2 and all(g.start_version == 2 for g in batch.groups)


async def test_crashes_mid_stream_lose_no_group_and_deliver_none_twice(
    nc: NATS, services: Services, reward: None
) -> None:
    await stack(services, speed=50.0)
    n_tasks = 10
    stream = await StreamClient.create(nc, spec(n_tasks, buffer_groups=4, async_bound=50, epochs=1))
    seen: list[int] = []
    tasks: list[str] = []
    crashed = False
    try:
        while True:
            try:
                batch = await stream.get_batch(2, timeout=120)
            except StreamEnded:
                break
            seen += [g.group for g in batch.groups]
            tasks += [g.task_id for g in batch.groups]
            if not crashed:
                crashed = True
                await services.crash("router")
                await services.crash("w1")
                await services.crash("scheduler")
                await start_scheduler(services)
                await start_router(services)
                await start_worker(services, "w1", max_running=16, speed=50.0)
    finally:
        await stream.close()
    assert len(seen) == len(set(seen)), seen
    assert sorted(tasks) == sorted({t for t in tasks}) and len(tasks) == n_tasks


async def test_rest_edge_serves_a_trainer_in_any_language(
    nc: NATS, services: Services, reward: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    await stack(services, speed=100.0, port=port)
    body = to_builtins(spec(4, buffer_groups=2, async_bound=1))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=AUTH) as http:
        for _ in range(50):  # uvicorn comes up beside the service
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/healthz")).status_code == 200:
                    break
            await asyncio.sleep(0.1)
        r = await http.post("/v1/streams", json=body)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert (await http.post("/v1/streams", json={**body, "async_bound": -1})).status_code == 422
        assert (await http.get(f"/v1/streams/{sid}")).json()["state"] == "running"
        r = await http.post(f"/v1/streams/{sid}/batch", json={"n_groups": 2, "timeout_s": 60})
        assert r.status_code == 200, r.text
        groups = r.json()["groups"]
        assert len(groups) == 2 and all(len(g["trajectories"]) == 2 for g in groups)
        r = await http.post(f"/v1/streams/{sid}/weights", json={"version": 1})
        assert r.status_code == 200 and r.json()["version"] == 1, r.text
        assert (await http.post(f"/v1/streams/{sid}/weights", json={"version": 1})).status_code == 409
        assert (await http.post(f"/v1/streams/{sid}/lease")).status_code == 200
        assert (await http.delete(f"/v1/streams/{sid}")).json()["state"] == "cancelled"
        r = await http.post(f"/v1/streams/{sid}/batch", json={"n_groups": 1, "timeout_s": 5})
        assert r.status_code == 410 and "cancelled" in r.text
        assert (await http.get("/v1/streams/str-nope")).status_code == 404
        # A trainer outside the bus moves the fleet by broadcast: the reference its transport staged, over REST.
        model, weights = spec(1).model, {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
        transport = CollectiveTransport(Sender())
        assert await fleet.push(http, model, 2, weights, transport, timeout_s=60) == 2
        assert transport.last is not None and transport.last.world_size == 3  # the trainer and both workers
        assert (await http.get(f"/v1/models/{model}/weights")).json()["version"] == "2"
        assert await fleet.push(http, model, 2, weights, transport, timeout_s=60) == 2  # again: not an error
        bad = {"version": 3, "weights": {"transport": "collective", "tensors": [["w", "float12", [3]]]}}
        assert (await http.post(f"/v1/models/{model}/weights", json=bad)).status_code == 422
        both = {"version": 3, "path": "/ckpt", "weights": {"transport": "disk", "path": "/ckpt"}}
        assert (await http.post(f"/v1/models/{model}/weights", json=both)).status_code == 422
        nowhere = {"version": 3, "weights": {"transport": "collective", "tensors": [["w", "float32", [3]]]}}
        r = await http.post(f"/v1/models/{model}/weights", json=nowhere)
        assert r.status_code == 422 and "address, group" in r.text
        # A model nobody serves, with the registry listing other models' workers: 404 on the first read (the
        # registry was read again twice, a second apart, as if its listing had come back empty). A listing that
        # does come back empty for a moment is still read again.
        reads: list[int] = []

        async def counted(*args: Any, **kwargs: Any) -> dict[str, Any]:
            members = await read_workers(*args, **kwargs)
            reads.append(len(members))
            return members

        monkeypatch.setattr(streams_module, "read_workers", counted)
        r = await http.post("/v1/models/qwen3-unserved/weights", json={"version": 1, "path": "/ckpt"})
        assert r.status_code == 404 and "no rollout worker serves 'qwen3-unserved'" in r.text
        assert reads and all(n == 0 for n in reads[:-1]) and reads[-1] > 0, reads


async def test_a_trainer_that_disappears_releases_its_stream(nc: NATS, services: Services) -> None:
    await start_scheduler(services)
    # No SDK (which renews the lease by itself): a trainer that created the stream and vanished.
    st = await request(nc, subjects.STREAM_CREATE, spec(2, lease_s=1.0), Stream, timeout_s=10)
    for _ in range(100):
        st = await request(nc, subjects.STREAM_GET, StreamRef(st.id), Stream)
        if st.state != "running":
            break
        await asyncio.sleep(0.1)
    assert st.state == "cancelled" and st.error == "trainer lease expired"

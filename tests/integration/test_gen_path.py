"""The generation path over a real nats-server: envmgr client -> router -> rollout worker -> engine."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS

from loom.protocol import (
    AbortRequest,
    DeadLetter,
    GenRequest,
    PriorityUpdate,
    TrajMeta,
    WorkerInfo,
    decode,
    encode,
    subjects,
)
from loom.runtime.bus import BusError, kv_key, request
from loom.runtime.genclient import GenClient, GenFailed
from services.router.router import Router
from tests.conftest import Services
from tests.integration.helpers import start_router, start_worker, until


async def _place(nc: NATS, job: str, traj: str, worker: str) -> None:
    kv = await nc.jetstream().key_value(subjects.KV_TRAJ)
    await kv.put(kv_key(job, traj), encode(TrajMeta(job, traj, worker_id=worker)))


def _req(rid: str, traj: str = "t0", n: int = 200) -> GenRequest:
    return GenRequest(
        rid=rid, job_id="job-1", traj_id=traj, step=0, input_len=1000, max_new_tokens=n, ignore_eos=True
    )


async def test_requests_run_on_their_planned_worker(nc: NATS, services: Services) -> None:
    await start_worker(services, "w0")
    await start_worker(services, "w1")
    router = await start_router(services)
    await until(lambda: set(router.workers) == {"w0", "w1"})
    await _place(nc, "job-1", "ta", "w1")
    await _place(nc, "job-1", "tb", "w0")
    client = GenClient(nc, lease_s=1.0)
    ra, rb = await asyncio.gather(client.generate(_req("a.0", "ta")), client.generate(_req("b.0", "tb")))
    assert (ra.worker_id, rb.worker_id) == ("w1", "w0")
    assert ra.output_len == rb.output_len == 200
    # A trajectory nobody planned is placed on a live worker and remembered in KV.
    rc = await client.generate(_req("c.0", "tc"))
    kv = await nc.jetstream().key_value(subjects.KV_TRAJ)
    assert decode((await kv.get(kv_key("job-1", "tc"))).value or b"", TrajMeta).worker_id == rc.worker_id


async def test_resent_request_is_generated_once(nc: NATS, services: Services) -> None:
    worker = await start_worker(services, "w0")
    await start_router(services)
    client = GenClient(nc, lease_s=1.0)
    first, second = await asyncio.gather(
        client.generate(_req("dup.0", n=400)), client.generate(_req("dup.0", n=400))
    )
    assert first == second
    again = await client.generate(_req("dup.0", n=400))
    assert again.output_len == 400
    assert worker.engine.load().generated_tokens == 400


async def test_router_crash_mid_request_loses_nothing(
    nc: NATS, services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The active router dies mid-request (no drain, as under kill -9); the standby takes its lease over and
    the callers' requests finish, none generated twice."""
    monkeypatch.setenv("LOOM_LEASE_TTL_S", "1.5")
    worker = await start_worker(services, "w0", max_running=4)
    first = await start_router(services)
    standby = asyncio.create_task(start_router(services, "router2"))
    client = GenClient(nc, lease_s=0.5)
    # Long requests: 4000 tokens take seconds even sped up, so the crash lands mid-generation; two of them
    # wait in the router's queue (the worker runs 4 at a time) and die with it.
    calls = [asyncio.create_task(client.generate(_req(f"r{i}.0", f"t{i}", n=4000))) for i in range(6)]
    await until(lambda: len(worker.inflight) == 4 and sum(len(q) for q in first.queues.values()) == 2)
    second = await standby
    assert first.active and not second.active and second.health() == {"role": "standby"}
    await services.crash("router")
    done = await asyncio.wait_for(asyncio.gather(*calls), 60)
    assert second.active
    assert all(r.output_len == 4000 for r in done)
    assert worker.engine.load().generated_tokens == 6 * 4000  # nothing generated twice


async def test_requests_wait_for_a_worker_and_survive_its_absence(nc: NATS, services: Services) -> None:
    router = await start_router(services)
    client = GenClient(nc, lease_s=0.5)
    call = asyncio.create_task(client.generate(_req("late.0")))
    await asyncio.sleep(1.0)
    assert not call.done() and len(router.queues[""]) == 1  # kept alive by router keepalives
    await start_worker(services, "w3")
    assert (await asyncio.wait_for(call, 20)).worker_id == "w3"


async def test_abort_frees_the_engine(nc: NATS, services: Services) -> None:
    worker = await start_worker(services, "w0")
    await start_router(services)
    client = GenClient(nc, lease_s=1.0)
    call = asyncio.create_task(client.generate(_req("long.0", n=100_000)))
    await until(lambda: worker.engine.load().running == 1)
    call.cancel()  # the client aborts downstream on cancellation
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: worker.engine.load().running == 0 and not worker.inflight)
    # Job-level abort reaches requests the router has forwarded.
    calls = [asyncio.create_task(client.generate(_req(f"j{i}.0", f"t{i}", n=100_000))) for i in range(3)]
    await until(lambda: worker.engine.load().running == 3)
    await nc.publish(subjects.GEN_ABORT, encode(AbortRequest(job_id="job-1")))
    outs = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert {o.finish_reason for o in outs} == {"abort"}


async def test_a_request_the_engine_cannot_hold_fails_fast(nc: NATS, services: Services) -> None:
    worker = await start_worker(services, "w0")
    await start_router(services)
    too_big = worker.engine.info.kv_capacity_tokens + 1
    with pytest.raises(GenFailed, match="invalid_request"):
        await asyncio.wait_for(GenClient(nc, lease_s=1.0).generate(_req("huge.0", n=too_big)), 10)


async def test_malformed_messages_get_errors_and_dead_letters(nc: NATS, services: Services) -> None:
    await start_worker(services, "w0")
    await start_router(services)
    with pytest.raises(BusError, match="bad_request"):
        await request(nc, subjects.GEN_REQUEST, {"rid": 5}, GenRequest, timeout_s=2)
    reply = await nc.request(subjects.GEN_REQUEST, b"\xc1 not msgpack", timeout=2)
    assert b"bad_request" in reply.data
    js = nc.jetstream()
    info = await js.stream_info(subjects.STREAM_DLQ)
    assert info.state.messages >= 2
    dl = decode((await js.get_msg(subjects.STREAM_DLQ, seq=1)).data or b"", DeadLetter)
    assert dl.subject == subjects.GEN_REQUEST and "bad payload" in dl.reason
    # The router is unharmed.
    ok = await GenClient(nc, lease_s=1.0).generate(_req("fine.0"))
    assert ok.output_len == 200
    kv = await js.key_value(subjects.KV_WORKERS)
    assert decode((await kv.get("w0")).value or b"", WorkerInfo).engine == "sim"


def _index_holds(router: Router) -> bool:
    """The router's indexes name exactly what its queues hold."""
    held = {rid: w for w, q in router.queues.items() for rid, _ in q.items()}
    by_traj: dict[str, set[str]] = {}
    for _w, q in router.queues.items():
        for rid, item in q.items():
            by_traj.setdefault(kv_key(item.req.job_id, item.req.traj_id), set()).add(rid)
    return router.queued_in == held and dict(router.traj_queued) == by_traj


async def test_queued_requests_are_indexed_through_reprioritising_aborts_and_a_lost_worker(
    nc: NATS, services: Services
) -> None:
    """The router finds a queued request, and a trajectory's queued requests, by index rather than by
    searching every worker's queue; each way a request leaves a queue keeps the index exact."""
    worker = await start_worker(services, "w0", max_running=1)
    router = await start_router(services)
    await until(lambda: set(router.workers) == {"w0"})
    client = GenClient(nc, lease_s=1.0)
    busy = asyncio.create_task(client.generate(_req("busy.0", "tz", n=100_000)))
    await until(lambda: worker.engine.load().running == 1)
    calls = {
        rid: asyncio.create_task(client.generate(_req(rid, traj, n=50)))
        for rid, traj in [("a.0", "ta"), ("b.0", "tb"), ("b.1", "tb"), ("c.0", "tc")]
    }
    await until(lambda: len(router.queued_in) == 4)
    assert _index_holds(router) and router.traj_queued[kv_key("job-1", "tb")] == {"b.0", "b.1"}
    await nc.publish(subjects.CONTROL_PRIORITY, encode(PriorityUpdate("job-1", "tb", priority=5.0)))
    await nc.publish(subjects.GEN_ABORT, encode(AbortRequest(rid="a.0")))
    await until(lambda: "a.0" not in router.queued_in)
    assert _index_holds(router) and kv_key("job-1", "ta") not in router.traj_queued
    calls.pop("a.0").cancel()
    # The worker dies: its queue moves to the unassigned queue, and on to the next worker.
    await services.crash("w0")
    await until(lambda: set(router.queued_in.values()) == {""}, within_s=20)
    assert _index_holds(router)
    await start_worker(services, "w1", max_running=4)
    done = await asyncio.wait_for(asyncio.gather(*calls.values()), 30)
    assert {r.worker_id for r in done} == {"w1"}
    assert router.queued_in == {} and dict(router.traj_queued) == {}
    busy.cancel()

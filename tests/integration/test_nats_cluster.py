"""Loom's bus on a three-server NATS cluster: every stream and bucket replicated three times, a client that
lists the servers moves to another when one dies, and the stream leader killed with -9 mid-flow loses
nothing; the killed server comes back and catches up."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from nats.errors import NoServersError

from loom.identity import nats_auth
from loom.protocol import PRESETS, Trajectory, WorkerInfo, encode, subjects
from loom.runtime import bus, results
from loom.runtime.natsserver import NatsCluster, NatsServer
from loom.runtime.workers import ContextLimits
from services.reward.store import store
from services.router.router import Router


async def _leader(js, stream: str) -> str:  # type: ignore[no-untyped-def]
    info = await js.stream_info(stream)
    assert info.cluster is not None and info.cluster.leader
    return str(info.cluster.leader)


async def test_a_stream_leader_killed_mid_flow_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_JS_REPLICAS", "3")
    cluster = NatsCluster(tmp_path / "nats")
    url = await cluster.start()
    cluster.supervise()
    assert len(bus.servers(url)) == 3
    nc = await bus.connect(url, "test")
    try:
        js = nc.jetstream(timeout=10)
        await bus.ensure_streams(js)
        for s in (subjects.STREAM_TRAJWORK, subjects.STREAM_RESULTS):
            assert (await js.stream_info(s)).config.num_replicas == 3
        kv = await js.key_value(subjects.KV_JOBS)
        assert (await kv.status()).stream_info.config.num_replicas == 3

        subject = subjects.STREAM_RESULTS_SUBJECTS[0].replace(">", "t.j")
        sent: list[int] = []

        async def publish(n: int) -> None:
            # A publish that fails while the stream elects a new leader is retried with the same id: the
            # stream keeps it once (its duplicate window).
            for _ in range(100):
                try:
                    await js.publish(subject, str(n).encode(), headers={"Nats-Msg-Id": f"m{n}"})
                    sent.append(n)
                    return
                except Exception:
                    await asyncio.sleep(0.1)
            raise AssertionError(f"message {n} never published")

        for n in range(50):
            await publish(n)
        leader = await _leader(js, subjects.STREAM_RESULTS)
        victim = next(s for s in cluster.servers if s.cluster is not None and s.cluster.server_name == leader)
        assert victim.proc is not None
        os.kill(victim.proc.pid, signal.SIGKILL)
        for n in range(50, 100):
            await publish(n)
        info = await js.stream_info(subjects.STREAM_RESULTS)
        assert info.state.messages == 100 and sent == list(range(100))
        # The killed server is restarted on its port and store and catches up: as a current replica, or as the
        # leader again, which raft only elects once its log holds everything.
        for _ in range(150):
            info = await js.stream_info(subjects.STREAM_RESULTS)
            replicas = {r.name: r for r in (info.cluster.replicas or [])} if info.cluster else {}
            caught_up = (leader in replicas and replicas[leader].current) or (
                info.cluster is not None and info.cluster.leader == leader and info.state.messages == 100
            )
            if victim.restarts and caught_up:
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"{leader} did not rejoin: {info.cluster}")
    finally:
        await nc.close()
        await cluster.stop()


async def test_a_client_that_must_fail_fast_does_so_on_any_list_of_servers(tmp_path: Path) -> None:
    """A health check (no reconnects) against a wrong password, or servers that are all gone, fails at once:
    nats-py read no reconnects as "keep picking a server forever" and hung there."""
    passwords = nats_auth.passwords(tmp_path / "pw")
    server = NatsServer(tmp_path / "nats", authorization=nats_auth.authorization(passwords))
    url = await server.start()
    try:
        for listed in (url, f"{url},nats://127.0.0.1:1"):
            started = time.monotonic()
            with pytest.raises(Exception, match=r"Authorization Violation|no servers"):
                await bus.connect(listed, "t", max_reconnect_attempts=0, credentials=("operator", "wrong"))
            assert time.monotonic() - started < 5
        started = time.monotonic()
        with pytest.raises(NoServersError):
            await bus.connect("nats://127.0.0.1:1,nats://127.0.0.1:2", "t", max_reconnect_attempts=0)
        assert time.monotonic() - started < 5
    finally:
        await server.stop()


async def test_what_a_trajectory_reads_and_stores_goes_on_through_a_leader_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reads and writes every running trajectory makes (the fleet's context limit before each call; its
    result, stored once scored) while the streams they use elect a new leader: none fails. The context-limit
    read raised a nats timeout here and ended its trajectory as failed (the likely cause of the HA e2e test's
    job completing with 11 of 12); the store failed with "no response from stream", spending the reward
    request's deliveries. Then the router's read of a job's routing, before it routes its first call: a
    nats timeout there answered the call "internal" and failed its trajectory (the HA test, 11 of 12 again)."""
    monkeypatch.setenv("LOOM_JS_REPLICAS", "3")
    cluster = NatsCluster(tmp_path / "nats")
    url = await cluster.start()
    cluster.supervise()
    nc = await bus.connect(url, "test")
    admin = nc.jetstream(timeout=10)
    # A short API timeout for the trajectory's side, so that an election outlasts it on an idle machine as it
    # does on a loaded one.
    js = nc.jetstream(timeout=1)
    beating: asyncio.Task[None] | None = None
    try:
        await bus.ensure_streams(admin)
        workers = await admin.key_value(subjects.KV_WORKERS)
        kv_traj = await js.key_value(subjects.KV_TRAJ)
        # The router as far as its job read goes: the buckets it reads, on the short-timeout side.
        router = Router.__new__(Router)
        router.jobs, router.kv_jobs, router.kv_traj = {}, await js.key_value(subjects.KV_JOBS), kv_traj

        async def heartbeat() -> None:
            now = time.time()
            info = WorkerInfo("w0", "m", "sim", "h100", 1, 8, 10_000, now, now, max_context_tokens=4096)
            await bus.through_failover(lambda: workers.put("w0", encode(info)))

        async def heartbeats() -> None:  # as a rollout worker's, every second
            while True:
                await asyncio.sleep(1.0)
                await heartbeat()

        await heartbeat()
        beating = asyncio.create_task(heartbeats())
        limits = ContextLimits(js, ttl_s=0.0)
        assert await limits.of("m") == 4096
        for stream in (f"KV_{subjects.KV_WORKERS}", subjects.STREAM_RESULTS, f"KV_{subjects.KV_JOBS}"):
            leader = await _leader(admin, stream)
            victim = next(s for s in cluster.servers if s.cluster and s.cluster.server_name == leader)
            assert victim.proc is not None
            restarts = victim.restarts
            os.kill(victim.proc.pid, signal.SIGKILL)
            for i in range(20):
                traj = Trajectory(
                    "j", f"t{stream}{i}", "task", 0, i, "replay", "completed", "stop", [], 0.0, 1.0
                )
                assert await limits.of("m") == 4096
                assert await store(js, kv_traj, nc, traj, 1.0)
                # A job the scheduler never stored is routed round robin; the read must answer to say so.
                assert (await router._job(f"j{stream}{i}")).policy == PRESETS["round_robin"]
                await asyncio.sleep(0.1)
            # Back and current before the next kill: two of three down would take the cluster's majority.
            await NatsCluster.ready(victim, 30)
            assert victim.restarts == restarts + 1
        assert await results.count_results(admin, "j") == 60
    finally:
        if beating is not None:
            beating.cancel()
        await nc.close()
        await cluster.stop()

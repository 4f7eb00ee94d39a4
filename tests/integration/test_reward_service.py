"""The reward service as it runs: its own process over a real nats-server, forking worker processes.

- chaos: 1,000 requests while workers are killed with SIGKILL at random: exactly 1,000 results, none twice;
- a request that keeps failing is dead-lettered with its reason and its trajectory stored unscored;
- the pool scales to zero when idle and back from zero on the next request.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from loom.protocol import (
    DeadLetter,
    Health,
    RewardRequest,
    Step,
    TaskSpec,
    Trajectory,
    decode,
    encode,
    subjects,
)
from loom.runtime import results

ROOT = Path(__file__).resolve().parents[2]
BUSY = "tests.integration.reward_fns:busy"


def _request(job: str, i: int, kind: str = BUSY, busy_s: float = 0.01) -> RewardRequest:
    traj = Trajectory(
        job, f"t{i}", "x", i, 0, "math", "completed", "stop", [Step(0, 5, 5, action="42")], 0.0, 1.0
    )
    return RewardRequest(traj, kind, "tenant-a", TaskSpec("x", {"ground_truth": "42"}), {"busy_s": busy_s})


async def _publish(js: Any, job: str, reqs: list[RewardRequest]) -> None:
    for r in reqs:
        key = results.msg_id(job, r.trajectory.traj_id)
        await js.publish(subjects.reward_submit("tenant-a", job), encode(r), headers={"Nats-Msg-Id": key})


async def _health(nc: NATS) -> dict[str, Any]:
    return decode((await nc.request(subjects.health("reward"), b"", timeout=5)).data, Health).details


class RewardProc:
    def __init__(self, nats_url: str, **env: str) -> None:
        self.env = dict(os.environ, LOOM_NATS_URL=nats_url, LOOM_INSTANCE="test-reward", **env)
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> RewardProc:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.reward", cwd=ROOT, env=self.env
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def bus(nats_url: str, nc: NATS) -> AsyncIterator[tuple[str, NATS]]:
    yield nats_url, nc


async def _until(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.mark.timeout(240)
async def test_chaos_sigkill_workers_exactly_once(bus: tuple[str, NATS]) -> None:
    url, nc = bus
    js = nc.jetstream()
    n = 1000
    env = {"LOOM_REWARD_MAX_WORKERS": "4", "LOOM_REWARD_STABLE_WINDOW_S": "1", "LOOM_REWARD_ACK_WAIT_S": "10"}
    async with RewardProc(url, **env):
        await _until(lambda: _ok(nc), 30, "the reward service")
        await _publish(js, "chaos", [_request("chaos", i) for i in range(n)])
        rng = random.Random(7)
        kills = 0
        while await results.count_results(js, "chaos") < n:
            workers = [w for w in (await _health(nc))["workers"] if w["pid"]]
            busy = [w for w in workers if w["inflight"]]
            if busy and rng.random() < 0.7:
                os.kill(rng.choice(busy)["pid"], signal.SIGKILL)
                kills += 1
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        await asyncio.sleep(2.0)  # anything redelivered late would land now
        stored = [t async for t in results.iter_results(js, "chaos")]
        h = await _health(nc)
    ids = [t.traj_id for t in stored]
    assert len(ids) == n and len(set(ids)) == n
    assert all(t.reward == 1.0 for t in stored)
    assert kills >= 5, kills
    assert h["cold_starts"] > 4  # killed workers were replaced
    assert (await js.stream_info(subjects.STREAM_REWARD)).state.messages == 0


async def _ok(nc: NATS) -> bool:
    try:
        return "workers" in await _health(nc)
    except Exception:
        return False


async def test_failing_requests_are_dead_lettered_and_stored_unscored(bus: tuple[str, NATS]) -> None:
    url, nc = bus
    js = nc.jetstream()
    async with RewardProc(url, LOOM_REWARD_MAX_DELIVER="2"):
        await _until(lambda: _ok(nc), 30, "the reward service")
        broken = _request("bad", 0, kind="tests.integration.reward_fns:broken")
        missing = _request("bad", 1, kind="tests.integration.reward_fns:missing")
        await _publish(js, "bad", [broken, missing, _request("bad", 2)])
        await js.publish(subjects.reward_submit("tenant-a", "bad"), b"\x93not a request")

        async def three() -> bool:
            return await results.count_results(js, "bad") == 3

        await _until(three, 30, "three stored results")
        stored = {t.traj_id: t for t in [t async for t in results.iter_results(js, "bad")]}
        await _until(lambda: _dlq_count(js, 3), 10, "three dead letters")
        letters = await _dlq(js)
    assert stored["t2"].reward == 1.0
    assert stored["t0"].reward is None and "after 2 deliveries" in stored["t0"].info["reward_error"]
    assert "always fails" in stored["t0"].info["reward_error"]
    assert stored["t1"].reward is None and "cannot load" in stored["t1"].info["reward_error"]
    reasons = " | ".join(d.reason for d in letters)
    assert "bad reward request" in reasons and "always fails" in reasons and "cannot load" in reasons
    assert (await js.stream_info(subjects.STREAM_REWARD)).state.messages == 0


async def _dlq(js: Any) -> list[DeadLetter]:
    info = await js.stream_info(subjects.STREAM_DLQ)
    if not info.state.messages:
        return []
    return [
        decode((await js.get_msg(subjects.STREAM_DLQ, seq=s)).data or b"", DeadLetter)
        for s in range(info.state.first_seq, info.state.last_seq + 1)
    ]


async def _dlq_count(js: Any, n: int) -> bool:
    return len(await _dlq(js)) >= n


async def test_pool_scales_to_zero_and_back(bus: tuple[str, NATS]) -> None:
    url, nc = bus
    js = nc.jetstream()
    env = {"LOOM_REWARD_STABLE_WINDOW_S": "1", "LOOM_REWARD_SCALE_TO_ZERO_GRACE_S": "0.5"}
    async with RewardProc(url, **env):
        await _until(lambda: _ok(nc), 30, "the reward service")
        assert (await _health(nc))["workers"] == []  # nothing to do, nothing running
        await _publish(js, "z", [_request("z", i, busy_s=0.05) for i in range(40)])

        async def grew() -> bool:
            return len((await _health(nc))["workers"]) >= 2

        await _until(grew, 10, "the pool to grow")

        async def drained() -> bool:
            return await results.count_results(js, "z") == 40 and not (await _health(nc))["workers"]

        await _until(drained, 30, "all results and an empty pool")
        t0 = time.monotonic()
        await _publish(js, "z", [_request("z", 99)])

        async def one_more() -> bool:
            return await results.count_results(js, "z") == 41

        await _until(one_more, 10, "the request sent to an empty pool")
        from_zero = time.monotonic() - t0
        h = await _health(nc)
    assert h["cold_starts"] >= 3 and from_zero < 5.0
    assert 0 < h["utilization"] <= 1.0

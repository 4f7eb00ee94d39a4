"""Heddle's control plane over NATS: planned placement, priority reordering, migration with warm-up."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS

from loom.clock import Clock
from loom.protocol import (
    PLAN_KEY,
    CancelJob,
    GenRequest,
    Job,
    JobSpec,
    Placement,
    PolicySpec,
    Prediction,
    PriorityUpdate,
    TaskSpec,
    ToolLatency,
    TrajMeta,
    TrajWork,
    decode,
    encode,
    subjects,
)
from loom.runtime.bus import kv_key
from loom.runtime.genclient import GenClient
from services.envmgr.context import LoopContext
from services.envmgr.prediction import await_prediction
from tests.conftest import Services
from tests.integration.helpers import start_router, start_worker, until

JOB = "job-heddle"


async def _store_job_and_plan(nc: NATS, plan: Placement) -> None:
    js = nc.jetstream()
    job = Job(JOB, JobSpec(policy=PolicySpec(preset="heddle")), "running", time.time(), len(plan.assignments))
    await (await js.key_value(subjects.KV_JOBS)).put(JOB, encode(job))
    kv = await js.key_value(subjects.KV_TRAJ)
    for traj, w in plan.assignments.items():
        await kv.put(kv_key(JOB, traj), encode(TrajMeta(JOB, traj, worker_id=w)))
    await kv.put(kv_key(JOB, PLAN_KEY), encode(plan))
    await nc.publish(subjects.CONTROL_PLACEMENT, encode(plan))


def _req(traj: str, step: int, input_len: int, n: int) -> GenRequest:
    return GenRequest(
        rid=f"{JOB}.{traj}.{step}",
        job_id=JOB,
        traj_id=traj,
        step=step,
        input_len=input_len,
        max_new_tokens=n,
        ignore_eos=True,
    )


async def test_heddle_plan_priorities_and_migration(nc: NATS, services: Services) -> None:
    w0 = await start_worker(services, "w0", max_running=8)
    w1 = await start_worker(services, "w1", max_running=1)  # one at a time: the rest wait in the router
    router = await start_router(services)
    await until(lambda: set(router.workers) == {"w0", "w1"})
    # The presorted plan: the longest trajectory on w0, the three shorter ones on w1. w0's group has room
    # for two, so that the two moves below fit (a move never fills a worker past its group size).
    plan = Placement(
        JOB,
        {"ta": "w0", "tb": "w1", "tc": "w1", "td": "w1"},
        predicted={"ta": 9000, "tb": 3000, "tc": 2000, "td": 1000},
        groups=["w0", "w1"],
        sizes=[2, 2],
    )
    await _store_job_and_plan(nc, plan)
    client = GenClient(nc, lease_s=1.0)

    # 0. Each trajectory's first call is ranked by the estimate it was placed by.
    await until(lambda: router.priorities.get(kv_key(JOB, "td")) == 1000.0)
    assert router.priorities[kv_key(JOB, "ta")] == 9000.0

    # 1. Trajectories are served on their planned workers.
    ra, rb = await asyncio.gather(
        client.generate(_req("ta", 0, 1000, 50)), client.generate(_req("tb", 0, 1000, 50))
    )
    assert (ra.worker_id, rb.worker_id) == ("w0", "w1")

    # 2. A priority update reorders a worker's queue: tb occupies w1 while tc then td wait behind it.
    blocker = asyncio.create_task(client.generate(_req("tb", 1, 1100, 300_000)))
    await until(lambda: w1.engine.load().running == 1)
    tc0 = asyncio.create_task(client.generate(_req("tc", 0, 1000, 100)))
    td0 = asyncio.create_task(client.generate(_req("td", 0, 1000, 100)))
    await until(lambda: len(router.queues["w1"]) == 2)
    queue = router.queues["w1"].jobs[JOB]
    assert queue.ordered() == [f"{JOB}.tc.0", f"{JOB}.td.0"]
    await nc.publish(
        subjects.CONTROL_PRIORITY,
        encode(PriorityUpdate(JOB, "td", 50_000.0, 50_000.0, 0, method="progressive")),
    )
    await until(lambda: queue.ordered() == [f"{JOB}.td.0", f"{JOB}.tc.0"])
    blocker.cancel()  # frees w1: the queue drains in its new order
    done_first, _ = await asyncio.wait({tc0, td0}, return_when=asyncio.FIRST_COMPLETED)
    assert td0 in done_first
    rc = await tc0
    assert rc.worker_id == "w1"

    # 3. A history-based estimate cannot tell siblings apart: however it jumps, nothing migrates.
    hist = PriorityUpdate(
        JOB, "tc", 90_000.0, 90_000.0, 0, context_len=1100, generated_tokens=100, method="history"
    )
    await nc.publish(subjects.CONTROL_PRIORITY, encode(hist))
    await until(lambda: router.priorities.get(kv_key(JOB, "tc")) == 90_000.0)
    assert router.placement[kv_key(JOB, "tc")] == "w1"

    # 4. During tc's tool call its prediction jumps past everyone's: it migrates to the long-group
    #    worker w0, which warms its 1,100-token context before the next step arrives.
    upd = PriorityUpdate(
        JOB, "tc", 80_000.0, 80_000.0, 0, context_len=1100, generated_tokens=100, method="progressive"
    )
    await nc.publish(subjects.CONTROL_PRIORITY, encode(upd))
    await until(lambda: router.placement.get(kv_key(JOB, "tc")) == "w0")
    # The move followed the new estimate; the queue order keeps the longest tc was ever given.
    assert router.priorities[kv_key(JOB, "tc")] == 90_000.0
    await until(lambda: w0.engine.core.cache.length(kv_key(JOB, "tc")) >= 1100)
    nxt = await client.generate(_req("tc", 1, 1200, 100))
    assert nxt.worker_id == "w0"
    assert nxt.cached_tokens >= 1100  # the warmed prefix was used: only the new 100 tokens prefilled
    # td's own jump (50,000 > ta's 9,000) had already moved it to w0 for its next step: two migrations.
    assert router.placement[kv_key(JOB, "td")] == "w0"
    assert router.transfers.m_moves._value.get() == 2

    # 5. tc starts again from its first call (its environment manager went away): it is ranked by what it
    #    was placed by again, not by what its abandoned run was estimated to need.
    restart = GenRequest(
        rid=f"{JOB}.tc.again.0", job_id=JOB, traj_id="tc", step=0, input_len=1000, max_new_tokens=10
    )
    await client.generate(restart)
    assert router.priorities[kv_key(JOB, "tc")] == 2000.0

    # 6. A cancelled job leaves nothing of its trajectories behind in the router.
    await nc.publish(subjects.CONTROL_CANCEL, encode(CancelJob(JOB)))
    kept = (router.placement, router.priorities, router.admitted, router.first_seen, router.served)
    await until(lambda: not any(k.startswith(JOB + ".") for index in kept for k in index))


async def test_a_trajectorys_requests_carry_the_longest_estimate_it_has_had(nc: NATS) -> None:
    """The environment manager publishes each new estimate as it is, and gives the trajectory's next request
    the longest so far: a router that takes over, with no priorities of its own, ranks by the requests."""
    ctx = LoopContext(nc=nc, clock=Clock(), gen=GenClient(nc), predict_timeout_s=5.0)
    work = TrajWork(JOB, "ta", TaskSpec("t"), 0, 0, "replay", "qwen3-8b", 10, 1000, ToolLatency())
    sub = await nc.subscribe(subjects.CONTROL_PRIORITY)

    async def estimate(remaining: float) -> Prediction:
        return Prediction("ta", remaining, 400 + remaining, "progressive")

    published = []
    priority = 0.0
    for remaining in (9600.0, 100.0):  # 10,000 after its second call, then 500 after its third
        task = asyncio.ensure_future(estimate(remaining))
        priority = await await_prediction(ctx, work, 2, task, priority, context_len=900, generated=400)
        published.append(decode((await sub.next_msg(timeout=5)).data, PriorityUpdate).priority)
    assert published == [10_000.0, 500.0]
    assert priority == 10_000.0

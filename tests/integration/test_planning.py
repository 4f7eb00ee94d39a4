"""The scheduler's initial plan against a predictor that answers: each trajectory weighs what it holds of a
worker's cache, as in the harness, and what an uncertain predictor cannot tell apart is spread over the
workers, not packed onto the few its optimum leaves room on."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loom.policies.placement import RoundRobinPlacement
from loom.protocol import (
    Job,
    JobSpec,
    Placement,
    PolicySpec,
    Prediction,
    PredictRequest,
    TaskSpec,
    TrajWork,
    WorkerInfo,
    decode,
    encode,
    subjects,
)
from services.scheduler.planning import plan
from services.scheduler.tasks import expand

WORKERS = 8
TASKS = 64
GROUP = 8


async def _planned(
    nc: NATS, tasks: list[TaskSpec], total: Callable[[PredictRequest], float], log_sd: float = 0.0
) -> tuple[Placement, list[TrajWork], list[str]]:
    """The plan of a job of ``tasks`` under Heddle's policy on the fleet, with a predictor on the bus that
    answers ``total`` at ``log_sd``; the job's trajectories and the workers' names."""

    async def answer(msg: Msg) -> None:
        req = decode(msg.data, PredictRequest)
        t = total(req)
        await msg.respond(encode(Prediction(req.traj_id, t, t, "test", log_sd=log_sd)))

    sub = await nc.subscribe(subjects.PREDICT, cb=answer)
    try:
        spec = JobSpec(env="math", tasks=tasks, group_size=GROUP, policy=PolicySpec(preset="heddle"))
        job = Job("job-plan", spec, "running", time.time(), len(tasks) * GROUP)
        now = time.time()
        workers = {
            f"w{i}": WorkerInfo(f"w{i}", "qwen3-8b", "sim", "h100", 1, 256, 400_000, now, now)
            for i in range(WORKERS)
        }
        rt = SimpleNamespace(nc=nc)  # what planning uses of a runtime: the connection
        works = expand(job.id, spec)
        p = await plan(rt, job, works, workers, RoundRobinPlacement())  # type: ignore[arg-type]
    finally:
        await sub.unsubscribe()
    assert len(p.assignments) == len(works)
    return p, works, sorted(workers)


async def _plan(nc: NATS, log_sd: float) -> dict[str, int]:
    """Trajectories per worker, planned under Heddle's policy with a predictor whose totals straddle one step
    of its error: the few it calls long, and the rest."""
    tasks = [TaskSpec(f"t{i}", {"prompt_tokens": 500}) for i in range(TASKS)]
    p, _, names = await _planned(nc, tasks, lambda r: 4000.0 if r.task_id in ("t0", "t1") else 1500.0, log_sd)
    counts = dict.fromkeys(names, 0)
    for w in p.assignments.values():
        counts[w] += 1
    return counts


async def test_an_uncertain_predictor_gets_a_spread_plan(nc: NATS) -> None:
    # Totals that stray by more than their difference: every worker takes its share.
    spread = await _plan(nc, 1.0)
    assert max(spread.values()) <= 1.1 * TASKS * GROUP / WORKERS, spread
    # Exact totals: the optimum isolates the two long tasks' samples and packs the rest onto fewer workers.
    exact = await _plan(nc, 0.0)
    assert max(exact.values()) > 1.5 * TASKS * GROUP / WORKERS, exact


async def _plan_contexts(nc: NATS) -> tuple[dict[str, int], dict[str, int]]:
    """Trajectories per worker, split by the KV cache they hold: half the tasks bring 24k-token prompts, half
    1k; their totals are predicted within 5% of each other, exactly (no error to spread by)."""
    tasks = [TaskSpec(f"t{i}", {"prompt_tokens": 24_000 if i < TASKS // 2 else 1_000}) for i in range(TASKS)]
    p, works, workers = await _planned(nc, tasks, lambda r: 2100.0 if r.context_len > 10_000 else 2000.0)
    heavy = {w.traj_id for w in works if int(w.task.id[1:]) < TASKS // 2}
    long_, short = dict.fromkeys(workers, 0), dict.fromkeys(workers, 0)
    for t, w in p.assignments.items():
        (long_ if t in heavy else short)[w] += 1
    return long_, short


async def test_the_plan_weighs_each_trajectory_by_the_cache_it_holds(nc: NATS) -> None:
    # As the harness weighs them: a worker holds about as much KV cache as any other (each trajectory its
    # prompt and half its output), not as many trajectories. Counting heads, the old plan put 63 of the long
    # prompts on each of four workers: 1.8x the mean cache.
    long_, short = await _plan_contexts(nc)
    held = {w: long_[w] * (24_000 + 2_100 / 2) + short[w] * (1_000 + 2_000 / 2) for w in long_}
    mean = sum(held.values()) / len(held)
    assert max(held.values()) <= 1.1 * mean, (long_, short)
    assert sum(long_.values()) == sum(short.values()) == TASKS * GROUP // 2

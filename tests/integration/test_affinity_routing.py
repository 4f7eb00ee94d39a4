"""Hardware affinity live: the router keeps each task tag on the GPU types its job maps it to."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from nats.aio.client import Client as NATS

from loom.protocol import GenRequest, Job, JobSpec, PolicySpec, encode, subjects
from loom.runtime.genclient import GenClient
from tests.conftest import Services
from tests.integration.helpers import start_router, start_worker, until

AFFINITY = {"coding": "h800", "default": "h20"}


async def _store(nc: NATS, job_id: str, preset: str, affinity: dict[str, str] | None) -> None:
    spec = JobSpec(policy=PolicySpec(preset=preset), hw_affinity=affinity)  # type: ignore[arg-type]
    kv = await nc.jetstream().key_value(subjects.KV_JOBS)
    await kv.put(job_id, encode(Job(job_id, spec, "running", time.time(), 0)))


def _req(job_id: str, traj: str, tag: str) -> GenRequest:
    return GenRequest(f"{job_id}.{traj}.0", job_id, traj, 0, 500, 20, ignore_eos=True, tag=tag)


@pytest.mark.parametrize("preset", ["round_robin", "verl", "sglang"])
async def test_each_tag_runs_only_on_its_gpu_type(nc: NATS, services: Services, preset: str) -> None:
    for wid, gpu in (("a", "h800"), ("b", "h20"), ("c", "h800"), ("d", "h20")):
        await start_worker(services, wid, gpu=gpu)
    router = await start_router(services)
    await until(lambda: len(router.workers) == 4)
    job = f"job-{preset}"
    await _store(nc, job, preset, AFFINITY)
    client = GenClient(nc, lease_s=1.0)
    tags = ["coding", "search", "tool_use", "coding"] * 6
    outs = await asyncio.gather(*(client.generate(_req(job, f"t{i}", tag)) for i, tag in enumerate(tags)))
    where = {tag: {o.worker_id for o, t in zip(outs, tags, strict=True) if t == tag} for tag in set(tags)}
    assert where["coding"] <= {"a", "c"} and where["search"] | where["tool_use"] <= {"b", "d"}
    # Both workers of a type share the load: the affinity narrows the choice, the policy still balances.
    assert len(where["coding"]) == 2 or preset == "verl"


async def test_without_the_mapped_gpu_type_a_tag_runs_anywhere(nc: NATS, services: Services) -> None:
    for wid in ("a", "b"):
        await start_worker(services, wid, gpu="h100")
    router = await start_router(services)
    await until(lambda: len(router.workers) == 2)
    await _store(nc, "job-x", "round_robin", AFFINITY)
    client = GenClient(nc, lease_s=1.0)
    outs = await asyncio.gather(*(client.generate(_req("job-x", f"t{i}", "coding")) for i in range(8)))
    assert {o.worker_id for o in outs} == {"a", "b"}


def test_affinity_rejects_a_malformed_gpu_name() -> None:
    import msgspec

    from loom.protocol import decode

    with pytest.raises(msgspec.ValidationError):
        decode(b'{"hw_affinity": {"coding": "h800; rm -rf"}}', JobSpec)


@pytest.mark.parametrize("preset", ["round_robin", "heddle"])
async def test_the_scheduler_plans_each_tag_on_its_gpu_type(nc: NATS, preset: str) -> None:
    from loom.policies.placement import RoundRobinPlacement
    from loom.protocol import TaskSpec, WorkerInfo
    from services.scheduler.planning import plan
    from services.scheduler.tasks import expand

    tasks = [TaskSpec(f"k{i}", {"tag": "coding", "prompt_tokens": 900}) for i in range(3)]
    tasks += [TaskSpec(f"m{i}", {"prompt_tokens": 200}) for i in range(3)]  # no tag: the env's, "math"
    spec = JobSpec(
        env="math", tasks=tasks, group_size=4, policy=PolicySpec(preset=preset), hw_affinity=AFFINITY
    )
    job = Job("job-plan", spec, "running", time.time(), 24)
    now = time.time()
    workers = {
        w: WorkerInfo(w, "qwen3-8b", "sim", gpu, 1, 64, 100_000, now, now)
        for w, gpu in (("a", "h800"), ("b", "h20"), ("c", "h800"), ("d", "h20"))
    }
    works = expand(job.id, spec)
    assert {w.tag for w in works} == {"coding", "math"}
    rt = SimpleNamespace(nc=nc)  # what planning uses of a runtime: the connection (no predictor answers)
    p = await plan(rt, job, works, workers, RoundRobinPlacement())  # type: ignore[arg-type]
    assert len(p.assignments) == 24
    for w in works:
        assert workers[p.assignments[w.traj_id]].gpu == ("h800" if w.tag == "coding" else "h20")

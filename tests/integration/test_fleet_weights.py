"""Fleet weight updates on real weights: two rollout workers with the transformers engine (tiny Qwen3
checkpoints on the CPU), a router and the scheduler over a real nats-server.

- suspend, update, resume: both workers end on the new version, and generations in flight during the update
  finish under it;
- a checkpoint one worker cannot load switches no worker, and the call says why;
- a worker that starts after an update joins the fleet at its version;
- fetched while generating (RollArt §5.2), the weights hold generation only for the switch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from nats.aio.client import Client as NATS

from loom import checkpoints as policy
from loom.engine.clients.hf import HFEngine
from loom.protocol import (
    AbortRequest,
    GenRequest,
    GenResult,
    StreamSpec,
    WeightOp,
    WeightOpReply,
    encode,
    subjects,
)
from loom.runtime.bus import BusError, request
from loom.runtime.genclient import GenClient
from loom.runtime.service import Runtime
from loom.trainer.client import StreamClient
from loom.weights.publish import CollectiveTransport, StoreTransport
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from tests.conftest import Services, need_shared
from tests.integration.helpers import start_router, start_worker, until
from tests.integration.test_stream_loop import start_scheduler

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
MODEL = "qwen3-tiny"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fleet")
    out = {
        "v0": policy.save(policy.build_tiny(seed=0, **SMALL), root / "v0"),
        "v1": policy.save(policy.build_tiny(seed=1, **SMALL), root / "v1"),
        # Same shape, another vocabulary: a worker serving it cannot load v1.
        "other": policy.save(policy.build_tiny(seed=2, **{**SMALL, "vocab_size": 151_936}), root / "other"),
    }
    yield out
    torch.set_num_threads(threads)


async def start_hf_worker(services: Services, wid: str, path: Path) -> RolloutWorker:
    holder: list[RolloutWorker] = []
    settings = RolloutSettings(worker_id=wid, engine="hf", model=MODEL, model_path=str(path), keepalive_s=0.2)

    def build(rt: Runtime) -> RolloutWorker:
        w = RolloutWorker(rt, settings, HFEngine(str(path), model=MODEL, max_running=8, seed=int(wid[1:])))
        holder.append(w)
        return w

    # Returned once it serves: its run loads the model and joins the fleet's weights first (a restarted worker
    # asked its version before the join was done answered '0' for '1', once, when this waited for health alone).
    await services.start(wid, "rollout", settings, build)
    return holder[0]


def _req(stream: str, traj: str, n: int) -> GenRequest:
    ids = [(97 * k + 13) % 5000 + 10 for k in range(24)]
    return GenRequest(
        rid=f"{stream}.{traj}.0",
        job_id=stream,
        traj_id=traj,
        step=0,
        input_len=len(ids),
        max_new_tokens=n,
        input_ids=ids,
        ignore_eos=True,
        return_logprob=True,
    )


def _stream_spec() -> StreamSpec:
    # The stream only names the model whose fleet moves; no environment manager runs here.
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    return StreamSpec(model=MODEL, dataset={"name": "swe-replay", "limit": 1}, group_size=1, lease_s=60.0)  # type: ignore[arg-type]


async def _fleet_of_two(
    nc: NATS, services: Services, start: Path
) -> tuple[RolloutWorker, RolloutWorker, Any, StreamClient, GenClient]:
    """Two transformers-engine workers serving ``start``, a router that sees both, the scheduler, a stream."""
    w0 = await start_hf_worker(services, "w0", start)
    w1 = await start_hf_worker(services, "w1", start)
    router = await start_router(services)
    await until(lambda: set(router.workers) == {"w0", "w1"}, within_s=20)
    await start_scheduler(services)
    stream = await StreamClient.create(nc, _stream_spec())
    return w0, w1, router, stream, GenClient(nc, lease_s=5.0)


async def test_suspend_update_resume_on_real_weight_workers(
    nc: NATS, services: Services, ckpts: dict[str, Path]
) -> None:
    w0, w1, _, stream, gen = await _fleet_of_two(nc, services, ckpts["v0"])
    try:
        # Generations long enough to be running on both workers when the update comes.
        calls = [asyncio.create_task(gen.generate(_req(stream.id, f"t{i}", 1200))) for i in range(4)]
        await until(lambda: w0.engine.load().running + w1.engine.load().running >= 4, within_s=30)
        res = await stream.update_weights(1, str(ckpts["v1"]))
        assert res.workers == ["w0", "w1"] and res.version == 1
        outs: list[GenResult] = await asyncio.gather(*calls)
        for out in outs:
            assert out.finish_reason == "length" and out.output_len == 1200
            assert out.weight_version == "1"  # finished under the new weights
            assert out.output_logprobs is not None and len(out.output_logprobs) == 1200
        assert {out.worker_id for out in outs} == {"w0", "w1"}
        assert w0.weight_version == w1.weight_version == "1"
        after = await gen.generate(_req(stream.id, "after", 4))
        assert after.weight_version == "1"
        # A worker that (re)starts now joins at version 1, not at the checkpoint it was started with.
        await services.stop("w1")
        w1 = await start_hf_worker(services, "w1", ckpts["v0"])
        assert w1.weight_version == "1"
    finally:
        await stream.close()


async def test_a_checkpoint_one_worker_cannot_load_switches_none(
    nc: NATS, services: Services, ckpts: dict[str, Path]
) -> None:
    w0 = await start_hf_worker(services, "w0", ckpts["v0"])
    w1 = await start_hf_worker(services, "w1", ckpts["other"])
    await start_router(services)
    await start_scheduler(services)
    stream = await StreamClient.create(nc, _stream_spec())
    try:
        with pytest.raises(BusError, match=r"not loaded, fleet kept: w1: ValueError: .*vocab size"):
            await stream.update_weights(1, str(ckpts["v1"]))
        assert w0.weight_version == w1.weight_version == "0"
        assert (await stream.refresh()).version == 0
        # Both serve again (resumed), still on their old weights.
        gen = GenClient(nc, lease_s=5.0)
        out = await gen.generate(_req(stream.id, "again", 3))
        assert out.weight_version == "0" and out.output_len == 3
    finally:
        await stream.close()


async def test_an_async_fetch_holds_generation_only_to_switch(nc: NATS, services: Services) -> None:
    """Simulated workers whose weights come over TCP (Qwen3-8B: 6.9 s, here 0.69 s at speed 10): fetched
    while they generate, the fleet pauses only for the commit and the requests in flight keep decoding;
    loaded inside the pause, the same update holds them for the whole transfer."""
    workers = [await start_worker(services, w, speed=10.0, weight_link="tcp") for w in ("w0", "w1")]
    router = await start_router(services)
    await until(lambda: set(router.workers) == {"w0", "w1"}, within_s=20)
    await start_scheduler(services)
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    spec = StreamSpec(
        model="qwen3-8b", dataset={"name": "swe-replay", "limit": 1}, group_size=1, lease_s=60.0
    )  # type: ignore[arg-type]
    stream = await StreamClient.create(nc, spec)
    gen = GenClient(nc, lease_s=5.0)
    transfer = 6.911 / 10.0

    def generated() -> int:
        return sum(w.engine.load().generated_tokens for w in workers)

    try:
        during: dict[bool, int] = {}
        for version, fetch in ((1, True), (2, False)):
            reqs = [
                GenRequest(
                    f"{stream.id}.{fetch}{i}.0", stream.id, f"{fetch}{i}", 0, 512, 20_000, ignore_eos=True
                )
                for i in range(4)
            ]
            calls = [asyncio.create_task(gen.generate(r)) for r in reqs]
            await until(lambda: sum(w.engine.load().running for w in workers) >= 4, within_s=20)
            before = generated()
            res = await stream.update_weights(version, None, async_fetch=fetch)
            during[fetch] = generated() - before
            if fetch:
                assert res.fetch_s >= 0.9 * transfer and res.pause_s < 0.5 * transfer
            else:
                assert res.fetch_s == 0.0 and res.pause_s >= 0.9 * transfer
            await nc.publish(subjects.GEN_ABORT, encode(AbortRequest(job_id=stream.id)))
            assert {o.finish_reason for o in await asyncio.gather(*calls)} == {"abort"}
        assert all(w.weight_version == "2" for w in workers)
        # Decoding went on through the fetch; through a pause of the same length it all but stopped.
        assert during[True] > 10 * max(1, during[False])
    finally:
        await stream.close()


async def test_a_pause_whose_scheduler_died_expires(nc: NATS, services: Services) -> None:
    """A scheduler that dies between pause and resume must not leave the fleet paused for ever."""
    w = await start_worker(services, "w9")
    reply = await request(nc, subjects.worker_weights("w9"), WeightOp("pause", "1", None, 0.5), WeightOpReply)
    assert reply.ok
    ready = await request(nc, subjects.worker_weights("w9"), WeightOp("prepare", "1", None), WeightOpReply)
    assert ready.ok
    await until(lambda: w.m_weight_ops.labels("pause", "expired")._value.get() == 1, within_s=5)
    # Resumed, the prepared weights discarded: a commit now has nothing to switch to.
    late = await request(nc, subjects.worker_weights("w9"), WeightOp("commit", "1", None), WeightOpReply)
    assert not late.ok and w.weight_version == "0"


def _served(worker: RolloutWorker) -> torch.Tensor:
    ids = torch.tensor([[5, 17, 230, 4095, 11]])
    with torch.inference_mode():
        return worker.engine._model(input_ids=ids).logits  # type: ignore[attr-defined]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([[5, 17, 230, 4095, 11]])).logits


async def test_weights_move_in_memory_by_broadcast_and_from_the_store(
    nc: NATS, services: Services, ckpts: dict[str, Path]
) -> None:
    """No checkpoint on disk: the trainer's model goes to both workers by a gloo broadcast (inside the pause,
    requests in flight kept), then by the bus's object store (fetched while generating); a worker that starts
    later takes the store's version itself, and one that starts after a broadcast holds its requests until
    the next broadcast includes it."""
    w0, w1, router, stream, gen = await _fleet_of_two(nc, services, ckpts["v0"])
    collective, store = CollectiveTransport(), StoreTransport(nc.jetstream(timeout=30))
    try:
        calls = [asyncio.create_task(gen.generate(_req(stream.id, f"t{i}", 600))) for i in range(4)]
        await until(lambda: w0.engine.load().running + w1.engine.load().running >= 4, within_s=30)
        v1 = policy.load(ckpts["v1"])
        res = await stream.update_weights(1, model=v1, transport=collective)
        assert res.workers == ["w0", "w1"] and res.fetch_s == 0  # received inside the pause
        assert collective.last is not None and collective.last.world_size == 3
        outs: list[GenResult] = await asyncio.gather(*calls)
        assert all(o.output_len == 600 and o.weight_version == "1" for o in outs)
        for w in (w0, w1):
            assert w.weight_version == "1" and torch.equal(_served(w), _logits(v1))

        v2 = policy.build_tiny(seed=3, **SMALL)
        res = await stream.update_weights(2, model=v2, transport=store)
        assert res.fetch_s > 0  # fetched while the fleet generated, held only to switch
        for w in (w0, w1):
            assert w.weight_version == "2" and torch.equal(_served(w), _logits(v2))
        w2 = await start_hf_worker(services, "w2", ckpts["v0"])
        await until(lambda: w2.weight_version == "2", within_s=30)
        assert torch.equal(_served(w2), _logits(v2))

        v3 = policy.build_tiny(seed=4, **SMALL)
        await stream.update_weights(3, model=v3, transport=collective)
        w3 = await start_hf_worker(services, "w3", ckpts["v0"])
        await until(lambda: "w3" in router.workers, within_s=20)
        assert w3.weight_version == "0" and w3.engine._paused  # type: ignore[attr-defined]
        v4 = policy.build_tiny(seed=5, **SMALL)
        res = await stream.update_weights(4, model=v4, transport=collective)
        assert res.workers == ["w0", "w1", "w2", "w3"]
        for w in (w0, w1, w2, w3):
            assert w.weight_version == "4" and torch.equal(_served(w), _logits(v4))
        assert not w3.engine._paused  # type: ignore[attr-defined]
        after = await gen.generate(_req(stream.id, "after", 4))
        assert after.weight_version == "4"
    finally:
        await stream.close()

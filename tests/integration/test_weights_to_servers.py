"""Weights in memory to vLLM and SGLang servers, through their own routes: the simulated servers join the
trainer's group and receive the tensors for real over gloo (names, dtypes, shapes and a CRC checked).

- each client alone: SGLang in flattened buckets, vLLM packed, the version labelled;
- the two together: one broadcast a tensor, the format both take;
- a group built as SGLang's own ``init_custom_process_group`` builds it joins Loom's trainer (what a real
  SGLang server does);
- a job runs on a vLLM worker and an SGLang worker while the fleet moves by broadcast and then from the
  bus's object store (fetched by each worker while it generates, relayed to its server at the switch): no
  trajectory lost, every turn labelled with the version that made it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
import torch
import torch.distributed as dist
from nats.aio.client import Client as NATS

from loom.clock import Clock
from loom.engine.clients.sglang import SGLangEngine
from loom.engine.clients.vllm import VLLMEngine
from loom.engine.fakes import sglang_server, vllm_server
from loom.engine.sim.engine import SimEngine
from loom.trainer.client import StreamClient
from loom.weights import GROUP, Incoming
from loom.weights.collective import Sender, announce
from loom.weights.publish import CollectiveTransport, StoreTransport
from services.rollout.__main__ import make_engine
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker
from tests.conftest import Services
from tests.integration.helpers import start_router, until
from tests.integration.test_stream_loop import reward, spec, start_envmgr, start_scheduler  # noqa: F401 - reward: a fixture
from tests.sim_servers import SimServer, started

MODEL = "qwen3-8b"
SPEED = 200.0


def state(seed: int) -> dict[str, torch.Tensor]:
    """A version's tensors: two dtypes, a layer's worth of shapes, an empty one."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(32, generator=g),
        "lm_head.bias": torch.empty(0),
    }


def server(api: str) -> SimServer:
    engine = SimEngine(model=MODEL, clock=Clock(SPEED), max_running=32)
    fake = sglang_server if api == "sglang" else vllm_server
    return SimServer(engine, fake.build_app(engine))


def client(api: str, url: str) -> Any:
    return (
        SGLangEngine(url, model=MODEL, poll_s=0.05)
        if api == "sglang"
        else VLLMEngine(url, model=MODEL, poll_s=0.05)
    )


async def broadcast(
    sender: Sender, clients: list[Any], version: str, weights: dict[str, torch.Tensor]
) -> Any:
    """Every client prepares and commits ``version`` while the sender broadcasts it, as a fleet update does."""
    ref = sender.ref(weights)
    world = len(clients) + 1
    sending = asyncio.ensure_future(asyncio.to_thread(sender.send, ref, weights, 60))
    for c in clients:
        await c.pause()
    mine = [msgspec.structs.replace(ref, rank=i + 1, world_size=world) for i in range(len(clients))]
    await asyncio.gather(
        *(c.prepare_weights(version, Incoming(r, timeout_s=60)) for c, r in zip(clients, mine, strict=True))
    )
    for c in clients:
        await c.commit_weights(version)
        await c.resume()
    return await sending


@pytest.mark.parametrize(("api", "fmt"), [("sglang", "buckets"), ("vllm", "vllm")])
async def test_one_server_takes_a_broadcast_through_its_own_routes(api: str, fmt: str) -> None:
    weights = state(1)
    async with server(api) as srv, started(client(api, srv.url)) as c:
        sender = Sender(bucket_bytes=4096)  # several buckets (SGLang: requests) and chunks (vLLM)
        sent = await broadcast(sender, [c], "7", weights)
        assert (sent.world_size, sent.format) == (2, fmt)
        assert sent.bytes == sum(t.numel() * t.element_size() for t in weights.values())
        assert c.weight_version == "7" and srv.engine.core.weight_version == "7"
        # The next update goes just as well: every update forms a group of its own.
        assert (await broadcast(sender, [c], "8", state(2))).format == fmt
        assert c.weight_version == "8"


async def test_vllm_and_sglang_together_take_one_broadcast_a_tensor() -> None:
    async with (
        server("sglang") as s1,
        server("vllm") as s2,
        started(client("sglang", s1.url)) as c1,
        started(client("vllm", s2.url)) as c2,
    ):
        sent = await broadcast(Sender(), [c1, c2], "3", state(3))
        assert (sent.world_size, sent.format) == (3, "per_tensor")
        assert c1.weight_version == c2.weight_version == "3"


def test_a_group_built_as_sglang_builds_it_joins_the_trainer() -> None:
    """SGLang's ``init_custom_process_group``: the rendezvous store prefixed with the group's name, then torch's
    ``_new_process_group_helper`` (which registers the group and prefixes the store again); Loom builds the
    same keys without the registry."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    sender, weights = Sender(), state(4)
    ref = sender.ref(weights)
    got: list[torch.Tensor] = []

    def sglang_rank() -> None:
        host, port = ref.address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))
        announce(store, 1, 2, ("per_tensor",))  # what Loom's SGLang client says before it asks the server
        prefixed = dist.PrefixStore(GROUP, store)
        pg, _ = _new_process_group_helper(
            2, 1, [], Backend("gloo"), prefixed, group_name=GROUP, timeout=datetime.timedelta(seconds=30)
        )
        _world.pg_group_ranks[pg] = {0: 0, 1: 1}
        try:
            for spec in ref.tensors:  # SGLang's receive loop: a broadcast a tensor, from rank 0
                buf = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
                dist.broadcast(buf, src=0, group=pg)
                got.append(buf)
        finally:
            dist.destroy_process_group(pg)
        store.set("loom/done/1", "ok")

    t = threading.Thread(target=sglang_rank)
    t.start()
    sent = sender.send(ref, weights, timeout_s=60)
    t.join(30)
    assert sent.format == "per_tensor"
    assert all(torch.equal(a, b) for a, b in zip(got, weights.values(), strict=True)) and len(got) == len(
        weights
    )


async def test_the_servers_refuse_what_their_real_counterparts_refuse() -> None:
    async with server("vllm") as srv, started(client("vllm", srv.url)) as c:
        # vLLM's init_info is a dataclass built with **init_info: an unknown field is a 500.
        bad = {
            "init_info": {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "group": "x",
            }
        }
        _, status, text = await c._request("POST", "/init_weight_transfer_engine", bad)
        assert status == 500 and "Invalid init_info" in text
        _, status, text = await c._request("POST", "/update_weights", {"update_info": {"names": []}})
        assert status == 500 and "start_weight_update" in text
    async with server("sglang") as srv, started(client("sglang", srv.url)) as c:
        body = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"}
        status, out = await c._answer("POST", "/update_weights_from_distributed", body)
        assert status == 400 and not out["success"] and "nope" in out["message"]


# ---------------------------------------------------------------- a job while the fleet moves


@contextlib.asynccontextmanager
async def fleet(services: Services) -> AsyncIterator[dict[str, SimServer]]:
    """A vLLM-API worker and an SGLang-API worker of one model, each driving its simulated server."""
    async with server("vllm") as sv, server("sglang") as ss:
        for wid, api, srv in (("wv", "vllm", sv), ("ws", "sglang", ss)):
            settings = RolloutSettings(
                worker_id=wid, engine=api, model=MODEL, speed=SPEED, keepalive_s=0.2,
                **{f"{api}_url": srv.url},
            )  # fmt: skip
            await services.start(
                wid, "rollout", settings, lambda rt, s=settings: RolloutWorker(rt, s, make_engine(rt, s))
            )
        router = await start_router(services)
        await until(lambda: set(router.workers) == {"wv", "ws"}, within_s=20)
        yield {"wv": sv, "ws": ss}


def versions_of(batch: Any) -> Iterator[str]:
    for g in batch.groups:
        for t in g.trajectories:
            assert t.status == "completed", t.error
            for step in t.steps:
                yield step.weight_version


@pytest.mark.usefixtures("reward")
async def test_a_job_runs_while_the_fleet_moves_by_broadcast_and_from_the_store(
    nc: NATS, services: Services
) -> None:
    async with fleet(services) as servers:
        await start_envmgr(services, SPEED)
        await start_scheduler(services)
        collective, store = (
            CollectiveTransport(Sender(bucket_bytes=4096)),
            StoreTransport(nc.jetstream(timeout=30)),
        )
        async with await StreamClient.create(
            nc, spec(8, model=MODEL, buffer_groups=4, async_bound=1)
        ) as stream:
            seen: set[str] = set()
            for version, transport in ((1, collective), (2, collective), (3, store)):
                batch = await stream.get_batch(2, timeout=120)
                assert all(len(g.trajectories) == 2 for g in batch.groups)  # no trajectory lost
                seen.update(versions_of(batch))
                res = await stream.update_weights(version, model=state(version), transport=transport)
                assert res.workers == ["ws", "wv"]
                # The store's version is fetched while the fleet generates; a broadcast comes inside the pause.
                assert (res.fetch_s > 0) == (transport is store)
                for srv in servers.values():
                    assert srv.engine.core.weight_version == str(version)
            last = await stream.get_batch(2, timeout=120)
            seen.update(versions_of(last))
        # Every turn was labelled by the weights that made it; the servers' labels reached the trajectories.
        assert seen <= {"default", "0", "1", "2", "3"} and seen & {"1", "2", "3"}, seen
        assert collective.last is not None and collective.last.format == "per_tensor"

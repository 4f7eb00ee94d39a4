"""The weights seam (loom.weights): buckets against brute force, a real gloo broadcast to two receivers, a
version handed to another process by its memory, the object store's publish and fetch on a real nats-server,
and the transformers engine serving what arrived."""

from __future__ import annotations

import glob
import itertools
import os
import subprocess
import sys
import threading

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loom import checkpoints
from loom.protocol import TensorSpec, WeightsRef
from loom.weights import Incoming, manifest
from loom.weights.collective import Cancelled, Sender, receive
from loom.weights.publish import CollectiveTransport, deliver_during

DTYPES = ("float32", "bfloat16", "int64")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 6), max_size=3)), max_size=12),
    st.integers(1, 200),
)
def test_buckets_cover_every_tensor_in_order_one_dtype_each_within_the_size(
    shapes: list[tuple[str, list[int]]], bucket_bytes: int
) -> None:
    specs = [TensorSpec(f"t{i}", d, s) for i, (d, s) in enumerate(shapes)]  # type: ignore[arg-type]
    bs = manifest.buckets(specs, bucket_bytes)
    assert [i for b in bs for i in range(b.first, b.last)] == list(range(len(specs)))
    for b in bs:
        members = specs[b.first : b.last]
        assert {s.dtype for s in members} == {b.dtype}
        size = sum(manifest.nbytes(s) for s in members)
        assert size <= bucket_bytes or len(members) == 1
        assert b.numel * torch.empty((), dtype=getattr(torch, b.dtype)).element_size() == size
    # Greedy: no two neighbouring buckets could have been one.
    for a, b in itertools.pairwise(bs):
        joined = sum(manifest.nbytes(s) for s in specs[a.first : b.last])
        assert a.dtype != b.dtype or joined > bucket_bytes


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(16, 16, generator=g),
        "layers.0.b": torch.randn(16, generator=g),
        "steps": torch.tensor([seed], dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }


def test_a_gloo_broadcast_reaches_every_worker_whole_and_checked() -> None:
    sender = Sender(bucket_bytes=1024)  # several buckets
    state = _state(1)
    ref = sender.ref(state)
    got: dict[int, dict[str, torch.Tensor]] = {}

    def worker(rank: int) -> None:
        got[rank] = receive(msgspec.structs.replace(ref, rank=rank, world_size=3), timeout_s=30)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sent = sender.send(ref, state, timeout_s=30)
    for t in threads:
        t.join(30)
    assert sent.world_size == 3
    assert sent.format == "buckets"  # ipc was offered, but a trainer on gloo broadcasts by default
    assert sent.bytes == sum(t.numel() * t.element_size() for t in state.values())
    for rank in (1, 2):
        assert list(got[rank]) == list(state)
        for name, t in state.items():
            assert got[rank][name].dtype == t.dtype and torch.equal(got[rank][name], t)


# A worker's process: its reference on stdin; what it took, saved where the test says.
_TAKER = """
import sys, msgspec, torch
from loom.protocol import WeightsRef
from loom.weights.collective import receive
ref = msgspec.json.decode(sys.stdin.buffer.read(), type=WeightsRef)
torch.save(receive(ref, 60), sys.argv[1])
"""


def test_worker_processes_on_the_trainer_s_host_map_the_version_from_its_memory(tmp_path) -> None:
    shm = set(glob.glob("/dev/shm/torch_*"))
    sender = Sender(bucket_bytes=1024, ipc=True)  # several buckets, more than two in flight
    state = _state(3)
    before = {k: v.untyped_storage().data_ptr() for k, v in state.items()}
    ref = sender.ref(state)
    workers = []
    for rank in (1, 2):
        w = subprocess.Popen(
            [sys.executable, "-c", _TAKER, str(tmp_path / f"got{rank}.pt")],
            stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert w.stdin is not None
        w.stdin.write(msgspec.json.encode(msgspec.structs.replace(ref, rank=rank, world_size=3)))
        w.stdin.close()
        workers.append(w)
    sent = sender.send(ref, state, timeout_s=60)
    assert [w.wait(60) for w in workers] == [0, 0]
    assert sent.format == "ipc" and sent.world_size == 3
    for rank in (1, 2):
        got = torch.load(tmp_path / f"got{rank}.pt")
        assert list(got) == list(state)
        for name, t in state.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    # The trainer's own weights were never lent (a bucket of one tensor is that tensor), and every bucket's
    # shared memory was freed once the workers were done.
    assert {k: v.untyped_storage().data_ptr() for k, v in state.items()} == before
    assert not any(v.is_shared() for v in state.values())
    assert set(glob.glob("/dev/shm/torch_*")) <= shm


def test_a_handle_that_names_anything_but_a_tensor_is_refused() -> None:
    import pickle

    from loom.weights.ipc import CpuHandle, _open

    class Payload:
        def __reduce__(self):  # what a rendezvous store run by someone else could hand a worker
            return (os.system, ("true",))

    with pytest.raises(ValueError, match="not a weights handle"):
        _open(pickle.dumps(Payload()))  # a handle is plain fields; a pickle is not even read
    with pytest.raises(ValueError, match="not a weights handle"):
        _open(msgspec.msgpack.encode({"type": "exec", "code": "whatever"}))
    with pytest.raises(ValueError, match="dtype 'system'"):
        _open(msgspec.msgpack.encode(CpuHandle(b"m", b"n", 8, "system", 2)))


def test_memory_is_handed_over_only_where_every_worker_shares_the_trainer_s_host() -> None:
    from loom.weights.collective import reachable

    offers = [["ipc", "buckets"], ["ipc", "buckets", "per_tensor"]]
    assert reachable(offers, ["a", "a"], "a") == offers
    without = [["buckets"], ["buckets", "per_tensor"]]
    assert reachable(offers, ["a", "b"], "a") == without  # one worker elsewhere: broadcast to all
    assert reachable(offers, ["a", "a"], None) == without  # the trainer hands over no memory


def test_a_broadcast_called_off_before_its_group_forms_ends() -> None:
    sender = Sender()
    ref = sender.ref(_state(2))
    sender.cancel(ref)
    with pytest.raises(Cancelled):
        sender.send(ref, _state(2), timeout_s=30)
    with pytest.raises(ValueError, match="rank"):
        receive(ref)  # rank 0 of 0: not a worker's reference


async def test_the_store_publishes_fetches_checks_and_keeps_the_last_versions(nats_url: str) -> None:
    from loom.runtime import bus
    from loom.weights.store import StorePublisher, fetch

    nc = await bus.connect(nats_url, "test")
    try:
        js = nc.jetstream(timeout=30)
        pub = StorePublisher(js, keep=2, bucket_bytes=1024)
        refs = [await pub.publish(v, _state(v)) for v in (1, 2, 3)]
        got = await fetch(js, refs[2])
        assert all(torch.equal(got[k], v) for k, v in _state(3).items())
        with pytest.raises(FileNotFoundError, match="w-v1"):
            await fetch(js, refs[0])  # beyond the last two: deleted
        with pytest.raises(ValueError, match="corrupt"):
            await fetch(js, msgspec.structs.replace(refs[1], checksum="crc32:00000000"))
        incoming = Incoming(refs[1], js)
        assert torch.equal((await incoming.tensors())["steps"], torch.tensor([2]))
    finally:
        await nc.close()


async def test_the_transformers_engine_serves_weights_that_came_by_broadcast(tmp_path) -> None:
    from loom.engine.clients.hf import HFEngine

    a, b = checkpoints.build_tiny(seed=0), checkpoints.build_tiny(seed=1)
    engine = HFEngine(str(checkpoints.save(a, tmp_path / "a")))
    await engine.start()
    try:
        transport = CollectiveTransport()
        ref = await transport.stage(1, b)
        mine = msgspec.structs.replace(ref, rank=1, world_size=2)
        await deliver_during(transport, ref, 60, engine.prepare_weights("1", Incoming(mine, timeout_s=60)))
        await engine.commit_weights("1")
        ids = torch.tensor([[1, 2, 3, 4]])
        with torch.inference_mode():
            want, served = b(input_ids=ids).logits, engine._model(input_ids=ids).logits  # type: ignore[misc]
        assert torch.equal(want, served)
        # A state that is not the serving architecture's is refused and the old weights stay.
        bad = {k: v for k, v in b.state_dict().items() if "layers.0." not in k}
        ref2 = msgspec.structs.replace(await transport.stage(2, bad), rank=1, world_size=2)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="Missing key"):
            await deliver_during(
                transport, ref2, 60, engine.prepare_weights("2", Incoming(ref2, timeout_s=60))
            )
        assert engine.weight_version == "1"
    finally:
        await engine.close()


def test_a_reference_names_its_transport_and_refuses_a_bad_address() -> None:
    ref = WeightsRef("collective", address="nohost", group="g", rank=1, world_size=2)
    with pytest.raises(ValueError, match="host:port"):
        receive(ref)
    assert Incoming.disk("/x").path == "/x"
    assert Incoming(WeightsRef("store", address="b", group="g")).path is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=15), st.integers(1, 100))
def test_vllm_chunks_close_right_after_the_tensor_that_crosses_the_buffer(
    sizes: list[int], buffer: int
) -> None:
    specs = [TensorSpec(f"t{i}", "uint8", [n]) for i, n in enumerate(sizes)]
    chunks = manifest.vllm_chunks(specs, buffer)
    assert [i for first, last, _ in chunks for i in range(first, last)] == list(range(len(sizes)))
    for k, (first, last, size) in enumerate(chunks):
        assert size == sum(sizes[first:last])
        # vLLM's producer and consumer both close a chunk at the first tensor that takes it past the buffer.
        assert all(sum(sizes[first:j]) <= buffer for j in range(first + 1, last))
        assert size > buffer or k == len(chunks) - 1


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["buckets", "vllm", "per_tensor"]), unique=True), min_size=1, max_size=4
    )
)
def test_the_format_picked_is_the_first_worker_s_best_that_every_worker_takes(
    offers: list[list[str]],
) -> None:
    from loom.weights.collective import pick

    got = pick(offers)
    everyone = [f for f in offers[0] if all(f in o for o in offers)]
    assert got == (everyone[0] if everyone else "")

"""The ``collective`` transport: the trainer broadcasts a version over torch.distributed to the workers.

Each update has a rendezvous of its own: ``Sender.ref`` opens a ``TCPStore`` (the trainer is its master and
rank 0 of the group), the scheduler gives each worker its rank and the group's size (``WeightsRef.rank``,
``.world_size``), and Loom's side of each worker announces itself in that store (``announce``: the group's
size, which is how the trainer learns it, and the wire format its engine takes) before its engine joins. The
group is built as SGLang's ``init_weights_update_group`` builds it (``init_custom_process_group``: the store,
prefixed with the group's name, and torch's own process-group helper), so a real SGLang server, Loom's
transformers and simulated engines and Loom's simulated servers all join the same way; one built apart from
torch.distributed's default group leaves a trainer's own ranks (TRL under accelerate) undisturbed. A group
per update follows a fleet whose workers come and go, at the cost of its rendezvous (milliseconds on gloo,
about a second on NCCL).

What goes on the wire, from rank 0, in the manifest's order, depends on the engines (``FORMATS``): each
worker announces the formats its engine takes, best first, and the trainer picks the first of the first
worker's that every worker takes, and publishes it:

- ``buckets``: runs of tensors of one dtype, each flattened into a typed buffer of up to ``bucket_bytes``
  (``manifest.buckets``): Loom's engines, and SGLang's ``flattened_bucket`` load format, one request a bucket.
- ``vllm``: vLLM's packed transfer, raw bytes in chunks cut by its rule (``manifest.vllm_chunks``).
- ``per_tensor``: one broadcast a tensor, which every engine takes (SGLang's default load format, vLLM
  unpacked): what a fleet of vLLM and SGLang servers together gets.
- ``ipc``: no broadcast at all, for engines in a process on the trainer's own host (``loom.weights.ipc``:
  each bucket's memory lent through the store, CUDA IPC on a GPU, where NCCL cannot put two ranks on one
  device, shared memory on CPUs). Offered by in-process engines and picked only where the trainer allows it
  (``Sender.ipc``, on by default on NCCL) and every worker announced the trainer's host (``loom/host/<rank>``).

A CRC-32 runs over the bytes as they move (on CPUs, by gloo or shared memory; on a GPU the buffers stay there
and NCCL checks its transfers); the trainer publishes its own, every receiver that can check does, and each worker's Loom side
marks itself done, after which the trainer closes the group and the store.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from loom.protocol import TensorSpec, WeightsRef
from loom.weights import GROUP, ipc, manifest

log = logging.getLogger(__name__)

__all__ = [
    "FORMATS",
    "Cancelled",
    "Sender",
    "agreed",
    "announce",
    "connect",
    "done",
    "failed",
    "join",
    "leave",
    "receive",
    "take",
    "verify",
]

Format = Literal["ipc", "buckets", "vllm", "per_tensor"]
FORMATS: tuple[Format, ...] = ("ipc", "buckets", "vllm", "per_tensor")


class Cancelled(RuntimeError):
    """The update was called off before its group formed."""


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address {address!r} is not host:port")
    return host, int(port)


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of an update's rendezvous store."""
    host, port = split_address(address)
    return dist.TCPStore(host, port, is_master=False, timeout=_timeout(timeout_s))


def announce(store: dist.Store, rank: int, world_size: int, formats: tuple[Format, ...]) -> None:
    """Loom's side of a worker, before its engine joins: the group's size, the formats its engine takes, and
    its host (which decides whether ``ipc`` can reach it)."""
    store.set("loom/world_size", str(world_size))
    store.set(f"loom/host/{rank}", ipc.host())
    store.set(f"loom/formats/{rank}", ",".join(formats))


def agreed(store: dist.Store, timeout_s: float) -> Format:
    """The format the trainer picked for this update (once every worker announced itself)."""
    store.wait(["loom/format"], _timeout(timeout_s))
    fmt = store.get("loom/format").decode()
    if fmt not in FORMATS:
        raise ValueError(f"the trainer found no weight format every worker takes ({fmt!r})")
    return fmt


def pick(offers: list[list[str]]) -> str:
    """The first format of the first worker's offer that every worker takes ("" when none)."""
    if not offers:
        return ""
    common = set(offers[0]).intersection(*offers[1:])
    return next((f for f in offers[0] if f in common), "")


def reachable(offers: list[list[str]], hosts: list[str], here: str | None) -> list[list[str]]:
    """The offers without ``ipc`` unless every worker is on ``here``, the trainer's host (None: the trainer
    hands over no memory)."""
    if here is not None and all(h == here for h in hosts):
        return offers
    return [[f for f in offer if f != "ipc"] for offer in offers]


def join(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float, name: str = GROUP
) -> Any:
    """Rank ``rank`` of the update's group (blocks until every rank has joined).

    Its keys lie in the store where SGLang's ``init_custom_process_group`` puts them (the store prefixed with
    the group's name, then torch's ``_new_process_group_helper`` prefixing it again and with the device), so a
    real SGLang server joins the same group; the backend is built directly rather than through the helper,
    whose registry holds one group of a name per process (a trainer and the workers in one process, as in
    tests, would collide)."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs a CUDA device; on CPUs use gloo")
    helper = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
    if backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", helper), rank, world_size, _timeout(timeout_s))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _timeout(timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", helper), rank, world_size, opts)


def leave(pg: Any) -> None:
    """Close the group (NCCL's communicator holds GPU memory until then)."""
    if hasattr(pg, "shutdown"):
        pg.shutdown()


def broadcast(pg: Any, buf: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([buf], opts)


def verify(store: dist.Store, running: int, timeout_s: float) -> None:
    """Check the CRC of the bytes a worker took against the one the trainer published after its last bucket."""
    store.wait(["loom/checksum"], _timeout(timeout_s))
    want = store.get("loom/checksum").decode()
    if want and manifest.checksum(running) != want:
        raise ValueError(f"weights arrived corrupt: checksum {manifest.checksum(running)}, sent {want}")


def done(store: dist.Store, rank: int) -> None:
    """Loom's side of a worker, once its engine holds the version: the trainer may close the group."""
    store.set(f"loom/done/{rank}", "ok")


def failed(store: dist.Store, rank: int, error: BaseException) -> None:
    """A worker that could not take the version says so, so the trainer does not wait for it in vain."""
    try:
        store.set(f"loom/done/{rank}", f"failed: {type(error).__name__}: {error}"[:500])
    except Exception:
        log.debug("could not tell the trainer that rank %d failed", rank, exc_info=True)


def chunks(
    tensors: list[TensorSpec], fmt: Format, bucket_bytes: int
) -> Iterator[tuple[int, int, torch.dtype, int]]:
    """(first, last, buffer dtype, buffer elements) of each broadcast, in order."""
    if fmt == "vllm":
        for first, last, size in manifest.vllm_chunks(tensors, bucket_bytes):
            yield first, last, torch.uint8, size
    elif fmt == "per_tensor":
        for i, spec in enumerate(tensors):
            yield i, i + 1, getattr(torch, spec.dtype), math.prod(spec.shape)
    else:
        for b in manifest.buckets(tensors, bucket_bytes):
            yield b.first, b.last, getattr(torch, b.dtype), b.numel


def unpack(
    first: int, last: int, buf: torch.Tensor, tensors: list[TensorSpec], fmt: Format
) -> Iterator[tuple[str, torch.Tensor]]:
    if fmt == "vllm":
        return manifest.unpack_bytes(first, last, buf, tensors)
    return manifest.unpack(first, last, buf, tensors)


def take(
    pg: Any, tensors: list[TensorSpec], fmt: Format, bucket_bytes: int, device: str, running: int
) -> tuple[dict[str, torch.Tensor], int]:
    """Receive every broadcast of a version: its tensors, and the CRC continued over their bytes."""
    out: dict[str, torch.Tensor] = {}
    for first, last, dtype, n in chunks(tensors, fmt, bucket_bytes):
        buf = torch.empty(n, dtype=dtype, device=device)
        broadcast(pg, buf).wait()
        if buf.device.type == "cpu":
            running = manifest.crc(buf, running)
        out.update(unpack(first, last, buf, tensors, fmt))
    return out, running


@dataclass
class Sent:
    world_size: int
    format: str
    bytes: int
    seconds: float  # from the group forming to every worker done
    wait_s: float  # waiting for the workers to announce themselves


class Sender:
    """The trainer's side: each update's rendezvous store, and rank 0 of its group.

    ``host`` is the interface to listen on, ``advertise`` the name the workers reach it by (a multi-node run:
    the trainer node's address). ``port`` 0 takes a free port per update; a fixed one is taken again by each
    update (one at a time). The backend's own connections need their ports too."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        backend: str | None = None,
        bucket_bytes: int = manifest.DEFAULT_BUCKET_BYTES,
        ipc: bool | None = None,
    ) -> None:
        self.host, self.port, self.advertise = host, port, advertise or host
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.bucket_bytes = bucket_bytes
        # Hand workers on this host the buckets' memory rather than broadcast them: by default on GPUs, where
        # NCCL cannot put two ranks on one device; on CPUs the gloo broadcast stays the default.
        self.ipc = self.backend == "nccl" if ipc is None else ipc
        self._stores: dict[str, dist.TCPStore] = {}
        self._cancelled: set[str] = set()
        self._updates = 0

    def ref(self, state: Mapping[str, torch.Tensor]) -> WeightsRef:
        """A new update: its store opened, the tensors it will carry (the checksum follows on the wire)."""
        self._updates += 1
        store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False)
        group = f"u{self._updates}-{store.port}"
        self._stores[group] = store
        return WeightsRef(
            "collective",
            address=f"{self.advertise}:{store.port}",
            group=group,
            backend=self.backend,  # type: ignore[arg-type]
            bucket_bytes=self.bucket_bytes,
            tensors=manifest.specs(state),
        )

    def cancel(self, ref: WeightsRef) -> None:
        """Call off ``ref``'s broadcast if its group has not formed (the fleet update failed before)."""
        self._cancelled.add(ref.group)

    def _announced(self, store: dist.TCPStore, ref: WeightsRef, timeout_s: float) -> tuple[int, Format]:
        t0 = time.monotonic()
        world = 0
        while True:
            if ref.group in self._cancelled:
                raise Cancelled(f"update {ref.group} called off before its workers joined")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(
                    f"the workers of update {ref.group} did not all announce themselves in {timeout_s:.0f} s"
                )
            if not world and store.check(["loom/world_size"]):
                world = int(store.get("loom/world_size"))
            if world and store.check([f"loom/formats/{r}" for r in range(1, world)]):
                break
            time.sleep(0.01)
        offers = [store.get(f"loom/formats/{r}").decode().split(",") for r in range(1, world)]
        hosts = [store.get(f"loom/host/{r}").decode() for r in range(1, world)]
        fmt = pick(reachable(offers, hosts, ipc.host() if self.ipc else None))
        store.set("loom/format", fmt)  # the workers wait for it (an empty one fails them)
        if not fmt:
            raise ValueError(f"the fleet's engines take no weight format in common: {offers}")
        return world, fmt  # type: ignore[return-value]

    def send(self, ref: WeightsRef, state: Mapping[str, torch.Tensor], timeout_s: float = 600.0) -> Sent:
        """Blocking: wait for the workers, form the group, broadcast every chunk, wait for every worker."""
        store = self._stores.pop(ref.group)
        try:
            t0 = time.monotonic()
            world, fmt = self._announced(store, ref, timeout_s)
            if fmt == "vllm" and self.backend == "nccl":
                raise RuntimeError(
                    "a real vLLM server takes a broadcast on its own NCCL communicator (PyNccl over vLLM's "
                    "StatelessProcessGroup): move its weights with the disk or store transport"
                )
            joined = time.monotonic()
            if fmt == "ipc":
                moved, crc = ipc.lend(store, range(1, world), state, ref.tensors, ref.bucket_bytes, timeout_s)
                store.set("loom/checksum", "" if crc is None else manifest.checksum(crc))
                store.wait([f"loom/done/{r}" for r in range(1, world)], _timeout(timeout_s))
            else:
                pg = join(store, 0, world, ref.backend, timeout_s)
                try:
                    moved, running = self._broadcast(pg, ref, state, fmt)
                    store.set("loom/checksum", manifest.checksum(running) if ref.backend == "gloo" else "")
                    store.wait([f"loom/done/{r}" for r in range(1, world)], _timeout(timeout_s))
                finally:
                    leave(pg)
            bad = {r: store.get(f"loom/done/{r}").decode() for r in range(1, world)}
            bad = {r: v for r, v in bad.items() if v != "ok"}
            if bad:
                raise ValueError(f"update {ref.group}: not every worker took it: {bad}")
            return Sent(world, fmt, moved, time.monotonic() - joined, joined - t0)
        finally:
            del store

    def _broadcast(
        self, pg: Any, ref: WeightsRef, state: Mapping[str, torch.Tensor], fmt: Format
    ) -> tuple[int, int]:
        device = torch.device("cuda") if ref.backend == "nccl" else torch.device("cpu")
        tensors = list(state.values())
        running, moved, work = 0, 0, None
        for first, last, _, _ in chunks(ref.tensors, fmt, ref.bucket_bytes):
            if fmt == "vllm":
                buf = manifest.pack_bytes(first, last, tensors, device)
            elif fmt == "per_tensor":
                buf = tensors[first].detach().contiguous().reshape(-1).to(device)
            else:
                buf = manifest.pack(first, last, tensors, device)
            if buf.device.type == "cpu":
                running = manifest.crc(buf, running)
            if work is not None:
                work.wait()
            work, moved = broadcast(pg, buf), moved + buf.numel() * buf.element_size()
        if work is not None:
            work.wait()
        return moved, running


def receive(ref: WeightsRef, timeout_s: float = 600.0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """An engine in the worker's own process: announce, join at its rank, take every bucket, check; the
    state dict."""
    if ref.transport != "collective" or ref.rank < 1 or ref.world_size < 2 or ref.rank >= ref.world_size:
        raise ValueError(f"not a collective update for a worker: rank {ref.rank} of {ref.world_size}")
    store = connect(ref.address, timeout_s)
    # A trainer on NCCL lends CUDA memory, which only a process with CUDA can map.
    can_map = ref.backend == "gloo" or torch.cuda.is_available()
    announce(
        store,
        ref.rank,
        ref.world_size,
        ("ipc", "buckets", "per_tensor") if can_map else ("buckets", "per_tensor"),
    )
    try:
        fmt = agreed(store, timeout_s)
        if fmt == "ipc":
            out, running = ipc.borrow(store, ref.rank, ref.tensors, ref.bucket_bytes, device, timeout_s)
            verify(store, running, timeout_s)  # the trainer publishes no checksum for CUDA buffers
        else:
            pg = join(store, ref.rank, ref.world_size, ref.backend, timeout_s)
            try:
                # gloo moves host memory: a worker on a GPU receives into it, then copies over
                out, running = take(
                    pg, ref.tensors, fmt, ref.bucket_bytes, device if ref.backend == "nccl" else "cpu", 0
                )
            finally:
                leave(pg)
            if ref.backend == "gloo":
                verify(store, running, timeout_s)
                out = {k: v.to(device) for k, v in out.items()}
    except BaseException as e:
        failed(store, ref.rank, e)
        raise
    done(store, ref.rank)
    return out

"""The ``collective`` transport: the trainer broadcasts a version over torch.distributed to the workers.

Each update forms a group of its own: the trainer is rank 0 and holds the rendezvous store (a ``TCPStore``
on one port, for the trainer's whole life); the scheduler gives each worker its rank and the group's size
(``WeightsRef.rank``, ``.world_size``), and the workers, as they join, write that size into the store, which
is how the trainer learns it (the trainer does not know the fleet; the scheduler does). The group is the
backend's own (``ProcessGroupGloo`` on CPUs, ``ProcessGroupNCCL`` on GPUs), built on the store directly, so
a trainer whose ranks already form torch.distributed's default group (TRL under accelerate) is not
disturbed. A group per update costs its rendezvous (milliseconds on gloo, about a second on NCCL) and
follows a fleet whose workers come and go without any bookkeeping of who joined which group.

Buckets (``manifest.buckets``) go one broadcast each from rank 0, in the manifest's order; the trainer packs
the next while one is on the wire. On gloo a checksum runs over the buffers as they move; on NCCL the
buffers stay on the GPU (NCCL checks its own transfers) and none is taken.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from loom.protocol import WeightsRef
from loom.weights import manifest

log = logging.getLogger(__name__)

__all__ = ["Cancelled", "Sender", "receive"]

# The key the workers write the group's size under (the trainer waits on it), in the group's own prefix.
WORLD_KEY = "loom/world_size"


class Cancelled(RuntimeError):
    """The update was called off before its group formed."""


def _group(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if not torch.cuda.is_available():
        raise RuntimeError("the nccl backend needs a CUDA device; on CPUs use gloo")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _broadcast(pg: Any, buf: torch.Tensor) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([buf], opts)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"rendezvous address {address!r} is not host:port")
    return host, int(port)


@dataclass
class Sent:
    world_size: int
    bytes: int
    seconds: float  # from the group forming to the last bucket on the wire
    wait_s: float  # waiting for the workers to join


class Sender:
    """The trainer's side: the rendezvous store, and rank 0 of each update's group.

    ``host`` is the interface to listen on, ``advertise`` the name the workers reach it by (a multi-node
    run: the trainer node's address; the port must be reachable from every worker, as must the ports the
    backend opens for its own connections)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        backend: str | None = None,
        bucket_bytes: int = manifest.DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.bucket_bytes = bucket_bytes
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False)
        self.address = f"{advertise or host}:{self.store.port}"
        self._nonce = secrets.token_hex(4)
        self._updates = 0
        self._cancelled: set[str] = set()

    def ref(self, state: Mapping[str, torch.Tensor]) -> WeightsRef:
        """A new update's reference: its group, and the tensors it will carry (no checksum: the trainer
        computes it as the buckets go, and the workers check theirs against the one it publishes)."""
        self._updates += 1
        return WeightsRef(
            "collective",
            address=self.address,
            group=f"{self._nonce}-{self._updates}",
            backend=self.backend,  # type: ignore[arg-type]
            bucket_bytes=self.bucket_bytes,
            tensors=manifest.specs(state),
        )

    def cancel(self, ref: WeightsRef) -> None:
        """Call off ``ref``'s broadcast if its group has not formed (the fleet update failed before)."""
        self._cancelled.add(ref.group)

    def send(self, ref: WeightsRef, state: Mapping[str, torch.Tensor], timeout_s: float = 600.0) -> Sent:
        """Blocking: wait for the workers, form the group, broadcast every bucket, publish the checksum."""
        store = dist.PrefixStore(f"{ref.group}/", self.store)
        t0 = time.monotonic()
        while not store.check([WORLD_KEY]):
            if ref.group in self._cancelled:
                raise Cancelled(f"update {ref.group} called off before its workers joined")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"no worker joined update {ref.group} in {timeout_s:.0f} s")
            time.sleep(0.02)
        world = int(store.get(WORLD_KEY))
        joined = time.monotonic()
        pg = _group(ref.backend, store, 0, world, timeout_s)
        device = torch.device("cuda") if ref.backend == "nccl" else torch.device("cpu")
        tensors = list(state.values())
        verify = ref.backend == "gloo"
        running, moved, work = 0, 0, None
        for b in manifest.buckets(ref.tensors, ref.bucket_bytes):
            buf = manifest.pack(b, tensors, device)
            if verify:
                running = manifest.crc(buf, running)
            if work is not None:
                work.wait()
            work, moved = _broadcast(pg, buf), moved + buf.numel() * buf.element_size()
        if work is not None:
            work.wait()
        store.set("loom/checksum", manifest.checksum(running) if verify else "")
        done = time.monotonic()
        del pg
        return Sent(world, moved, done - joined, joined - t0)


def receive(ref: WeightsRef, timeout_s: float = 600.0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A worker's side: join ``ref``'s group at its rank, take every bucket, check them; the state dict."""
    if ref.transport != "collective" or ref.rank < 1 or ref.world_size < 2 or ref.rank >= ref.world_size:
        raise ValueError(f"not a collective update for a worker: rank {ref.rank} of {ref.world_size}")
    host, port = _split(ref.address)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{ref.group}/", dist.TCPStore(host, port, is_master=False, timeout=timeout))
    store.set(WORLD_KEY, str(ref.world_size))
    pg = _group(ref.backend, store, ref.rank, ref.world_size, timeout_s)
    out: dict[str, torch.Tensor] = {}
    running = 0
    for b in manifest.buckets(ref.tensors, ref.bucket_bytes):
        buf = torch.empty(b.numel, dtype=getattr(torch, b.dtype), device=device)
        _broadcast(pg, buf).wait()
        if ref.backend == "gloo":
            running = manifest.crc(buf, running)
        out.update(manifest.unpack(b, buf, ref.tensors))
    del pg
    # The trainer writes it once its last bucket is on the wire; a worker may get there first.
    store.wait(["loom/checksum"], timeout)
    want = store.get("loom/checksum").decode()
    if want and manifest.checksum(running) != want:
        raise ValueError(
            f"weights {ref.group} arrived corrupt: checksum {manifest.checksum(running)}, sent {want}"
        )
    return out

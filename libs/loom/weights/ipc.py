"""The collective transport's ``ipc`` format: the trainer lends each worker on its host the buckets' memory
rather than broadcasting them (verl's hybrid engine, vLLM's IPC weight-transfer engine: a trainer and its
engines on one GPU, where NCCL cannot put two ranks on one device).

For each bucket the trainer packs the tensors where its weights are, and lends every worker a copy of its own:
the copy's handle goes into the update's rendezvous store under ``loom/ipc/<rank>/<bucket>``; the worker maps
it, copies it into its own memory and acknowledges (``loom/ipc/ack/<rank>/<bucket>``). A copy per worker keeps
torch's sharing as it is made to be used, one producer and one consumer per handle; at most two buckets per
worker are lent at a time, so the trainer's memory holds two buckets a worker beyond its weights.

A handle is a CUDA IPC handle on a GPU (torch's own reduction, unpickled with nothing but torch's CUDA
rebuild allowed: the store's address comes from the update's request) or, on CPUs, the name of a
shared-memory file, published as plain fields.
"""

from __future__ import annotations

import datetime
import importlib
import io
import json
import os
import pickle
import socket
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

from loom.protocol import TensorSpec
from loom.weights import manifest

__all__ = ["borrow", "host", "lend"]

# Buckets lent to each worker at a time: one being copied while the next is packed.
IN_FLIGHT = 2


def host() -> str:
    """Where shared memory and CUDA IPC reach: this machine (its name and this boot of its kernel) and this
    process's IPC namespace (containers on one host may each have their own)."""

    def read(path: str, link: bool = False) -> str:
        try:
            if link:
                return os.readlink(path)
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return ""

    boot, ns = read("/proc/sys/kernel/random/boot_id"), read("/proc/self/ns/ipc", link=True)
    return f"{socket.gethostname()}/{boot}/{ns}"


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _handle(buf: torch.Tensor) -> bytes:
    if buf.is_cuda:
        return b"cuda:" + bytes(ForkingPickler.dumps(buf))
    storage = buf.untyped_storage()
    manager, name, size = storage._share_filename_cpu_()  # moves buf into a shared-memory file
    storage._shared_incref()  # the worker's reference, until it has opened the file (as torch's reduction does)
    fields = {"manager": manager.hex(), "name": name.hex(), "size": size,
              "dtype": manifest.dtype_name(buf), "numel": buf.numel()}  # fmt: skip
    return b"cpu:" + json.dumps(fields).encode()


class _CudaOnly(pickle.Unpickler):
    """Unpickles a CUDA tensor's IPC handle and nothing else."""

    ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a weights handle may not name {module}.{name}")


def _open(payload: bytes) -> torch.Tensor:
    kind, _, body = payload.partition(b":")
    if kind == b"cuda":
        return _CudaOnly(io.BytesIO(body)).load()
    if kind != b"cpu":
        raise ValueError(f"unknown weights handle {kind[:16]!r}")
    f = json.loads(body)
    storage = torch.UntypedStorage._new_shared_filename_cpu(
        bytes.fromhex(f["manager"]), bytes.fromhex(f["name"]), int(f["size"])
    )
    storage._shared_decref()  # the trainer's reference for this worker, now that the file is open
    return torch.empty(0, dtype=getattr(torch, f["dtype"])).set_(storage, 0, (int(f["numel"]),), (1,))


def lend(
    store: dist.Store,
    ranks: Sequence[int],
    state: Mapping[str, torch.Tensor],
    specs: list[TensorSpec],
    bucket_bytes: int,
    timeout_s: float,
) -> tuple[int, int]:
    """The trainer's side: lend every bucket to every worker; (bytes lent per worker, the CRC over them, on
    CPUs). Returns once every worker acknowledged every bucket."""
    tensors = list(state.values())
    device = tensors[0].device if tensors else torch.device("cpu")
    lent: dict[int, list[torch.Tensor]] = {}
    moved = running = 0
    for i, b in enumerate(manifest.buckets(specs, bucket_bytes)):
        first, last = b.first, b.last
        packed = manifest.pack(first, last, tensors, device)
        if packed.device.type == "cpu":
            running = manifest.crc(packed, running)
        # A bucket of one tensor is that tensor: the trainer's own weights are never lent.
        own = packed.untyped_storage().data_ptr() == tensors[first].untyped_storage().data_ptr()
        copies = [packed if k == 0 and not own else packed.clone() for k in range(len(ranks))]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the workers read them from their own streams
        for r, buf in zip(ranks, copies, strict=True):
            store.set(f"loom/ipc/{r}/{i}", _handle(buf))  # type: ignore[arg-type]  # takes bytes
        lent[i] = copies
        moved += packed.numel() * packed.element_size()
        if i + 1 >= IN_FLIGHT:
            _returned(store, ranks, i + 1 - IN_FLIGHT, lent, timeout_s)
    for i in sorted(lent):
        _returned(store, ranks, i, lent, timeout_s)
    return moved, running


def _returned(
    store: dist.Store, ranks: Sequence[int], i: int, lent: dict[int, list[torch.Tensor]], timeout_s: float
) -> None:
    store.wait([f"loom/ipc/ack/{r}/{i}" for r in ranks], _timeout(timeout_s))
    buckets = lent.pop(i)
    cuda = any(b.is_cuda for b in buckets)
    del buckets
    if cuda:
        torch.cuda.ipc_collect()  # free what the workers have let go of


def borrow(
    store: dist.Store, rank: int, specs: list[TensorSpec], bucket_bytes: int, device: str, timeout_s: float
) -> tuple[dict[str, torch.Tensor], int]:
    """A worker's side: map each bucket lent to it, copy it onto ``device``, let go of it and acknowledge; its
    tensors, and the CRC over the bytes (on CPUs)."""
    out: dict[str, torch.Tensor] = {}
    running = 0
    for i, b in enumerate(manifest.buckets(specs, bucket_bytes)):
        first, last = b.first, b.last
        store.wait([f"loom/ipc/{rank}/{i}"], _timeout(timeout_s))
        view = _open(store.get(f"loom/ipc/{rank}/{i}"))
        if view.device.type == "cpu":
            running = manifest.crc(view, running)
        buf = view.to(device, copy=True)
        if view.is_cuda:
            torch.cuda.synchronize(view.device)
        del view
        store.set(f"loom/ipc/ack/{rank}/{i}", "ok")
        out.update(manifest.unpack(first, last, buf, specs))
    return out, running

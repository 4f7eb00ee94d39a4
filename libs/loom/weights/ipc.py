"""The collective transport's ``ipc`` format: the trainer lends each worker on its host the buckets' memory
rather than broadcasting them (verl's hybrid engine, vLLM's IPC weight-transfer engine: a trainer and its
engines on one GPU, where NCCL cannot put two ranks on one device).

For each bucket the trainer packs the tensors where its weights are, and lends every worker a copy of its own:
the copy's handle goes into the update's rendezvous store under ``loom/ipc/<rank>/<bucket>``; the worker maps
it, copies it into its own memory and acknowledges (``loom/ipc/ack/<rank>/<bucket>``). A copy per worker keeps
torch's sharing as it is made to be used, one producer and one consumer per handle; at most two buckets per
worker are lent at a time, so the trainer's memory holds two buckets a worker beyond its weights.

A handle is a msgspec struct of plain fields, never a pickle (the store's address comes from the update's
request): on a GPU, the fields torch's own reduction gives a CUDA tensor (its CUDA IPC handle, reference
counter and event), rebuilt with torch's ``rebuild_cuda_tensor``; on CPUs, the name of a shared-memory file.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing.reductions as reductions

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


class CudaHandle(msgspec.Struct, tag="cuda", frozen=True):
    """A CUDA tensor lent by IPC: what torch's ``reduce_tensor`` gives ``rebuild_cuda_tensor``."""

    size: list[int]
    stride: list[int]
    offset: int
    dtype: str
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes | None
    event_sync: bool


class CpuHandle(msgspec.Struct, tag="cpu", frozen=True):
    """A CPU tensor lent as a shared-memory file (torch's ``file_system`` sharing)."""

    manager: bytes
    name: bytes
    size: int
    dtype: str
    numel: int


Handle = CudaHandle | CpuHandle
_decode = msgspec.msgpack.Decoder(Handle).decode


def _handle(buf: torch.Tensor) -> bytes:
    if buf.is_cuda:
        rebuild, args = reductions.reduce_tensor(buf)
        if rebuild is not reductions.rebuild_cuda_tensor or args[4] is not torch.storage.TypedStorage:
            raise TypeError(
                f"torch reduced a CUDA bucket as {rebuild.__name__}({args[4]!r}), not rebuild_cuda_tensor"
            )
        _, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, counter, counter_offset, \
            event, event_sync = args  # fmt: skip
        h: Handle = CudaHandle(list(size), list(stride), offset, manifest.dtype_name(buf), device, handle,
                               size_bytes, offset_bytes, counter, counter_offset, event, event_sync)  # fmt: skip
    else:
        storage = buf.untyped_storage()
        manager, name, size = storage._share_filename_cpu_()  # moves buf into a shared-memory file
        storage._shared_incref()  # the worker's reference, until it has opened the file (as torch's reduction does)
        h = CpuHandle(manager, name, size, manifest.dtype_name(buf), buf.numel())
    return msgspec.msgpack.encode(h)


def _open(payload: bytes) -> torch.Tensor:
    try:
        h = _decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a weights handle: {e}") from e
    dtype = getattr(torch, h.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a weights handle: dtype {h.dtype!r}")
    if isinstance(h, CudaHandle):
        return reductions.rebuild_cuda_tensor(
            torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset, torch.storage.TypedStorage, dtype,
            h.device, h.handle, h.size_bytes, h.offset_bytes, False, h.ref_counter, h.ref_counter_offset, h.event,
            h.event_sync,
        )  # fmt: skip
    storage = torch.UntypedStorage._new_shared_filename_cpu(h.manager, h.name, h.size)
    storage._shared_decref()  # the trainer's reference for this worker, now that the file is open
    return torch.empty(0, dtype=dtype).set_(storage, 0, (h.numel,), (1,))


def lend(
    store: dist.Store,
    ranks: Sequence[int],
    state: Mapping[str, torch.Tensor],
    specs: list[TensorSpec],
    bucket_bytes: int,
    timeout_s: float,
) -> tuple[int, int | None]:
    """The trainer's side: lend every bucket to every worker; (bytes lent per worker, the CRC over them: None
    on a GPU, whose buffers are not read back). Returns once every worker acknowledged every bucket."""
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
    return moved, running if device.type == "cpu" else None


def _returned(
    store: dist.Store, ranks: Sequence[int], i: int, lent: dict[int, list[torch.Tensor]], timeout_s: float
) -> None:
    store.wait([f"loom/ipc/ack/{r}/{i}" for r in ranks], timedelta(seconds=timeout_s))
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
        store.wait([f"loom/ipc/{rank}/{i}"], timedelta(seconds=timeout_s))
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

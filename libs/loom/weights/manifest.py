"""What a weights version holds, and how it is cut into buckets to move.

A version is the model's state dict in its own order, each tensor in its own dtype. It moves in buckets: runs
of consecutive tensors (a layer's tensors lie together in the state dict, so a bucket is a few layers) of one
dtype, each flattened into one buffer of at most ``bucket_bytes`` (a single larger tensor is a bucket of its
own). One dtype per bucket keeps every buffer a typed tensor, which NCCL needs on both sides and SGLang's
``flattened_bucket`` format expects. The checksum covers every byte of every tensor in order, so a receiver
knows it holds exactly what the trainer sent.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from loom.protocol import TensorSpec

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "buckets",
    "check_against",
    "checksum",
    "crc",
    "pack",
    "specs",
    "unpack",
]

# verl's checkpoint engines default to 512 MiB buckets, vLLM's packed transfer to 1 GiB: a bucket this size
# is one collective call, and two of them (one filling, one in flight) stay well inside an engine's memory.
DEFAULT_BUCKET_BYTES = 256 << 20


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def nbytes(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * getattr(torch, spec.dtype).itemsize


def specs(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, dtype_name(t), list(t.shape)) for name, t in state.items()]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Bucket:
    """Tensors ``first`` to ``last`` (exclusive) of the manifest, all of ``dtype``: ``numel`` elements."""

    first: int
    last: int
    dtype: str
    numel: int


def buckets(tensors: list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    out: list[Bucket] = []
    first, numel, size = 0, 0, 0
    for i, spec in enumerate(tensors):
        n = nbytes(spec)
        elems = n // max(1, getattr(torch, spec.dtype).itemsize)
        if i > first and (spec.dtype != tensors[first].dtype or size + n > bucket_bytes):
            out.append(Bucket(first, i, tensors[first].dtype, numel))
            first, numel, size = i, 0, 0
        numel += elems
        size += n
    if first < len(tensors):
        out.append(Bucket(first, len(tensors), tensors[first].dtype, numel))
    return out


def pack(
    first: int, last: int, tensors: list[torch.Tensor], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Tensors ``first`` to ``last`` (one dtype), flattened into one buffer of it."""
    parts = [t.detach().reshape(-1) for t in tensors[first:last]]
    if len(parts) == 1:
        return parts[0].to(device).contiguous()
    return torch.cat([p.to(device) for p in parts])


def unpack(
    first: int, last: int, buf: torch.Tensor, tensors: list[TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors ``first`` to ``last`` as views of ``buf`` (which they keep alive)."""
    at = 0
    for spec in tensors[first:last]:
        n = 1
        for d in spec.shape:
            n *= d
        yield spec.name, buf[at : at + n].view(spec.shape)
        at += n
    if at != buf.numel():
        raise ValueError(f"bucket of {buf.numel()} elements holds {at}")


def crc(buf: torch.Tensor, running: int = 0) -> int:
    """CRC-32 of a bucket's buffer, continuing ``running``: both sides compute it over the buffers that moved,
    bucket after bucket, so the check costs one pass over memory already at hand."""
    data = buf.detach().contiguous().cpu().reshape(-1)
    return zlib.crc32(data.view(torch.uint8).numpy().data, running) if data.numel() else running


def checksum(running: int) -> str:
    return f"crc32:{running:08x}"


def check_against(tensors: list[TensorSpec], got: Mapping[str, torch.Tensor]) -> None:
    """``got`` holds exactly the manifest's tensors (names, dtypes, shapes)."""
    want = {s.name: s for s in tensors}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"weights differ from the manifest: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in got.items():
        s = want[name]
        if dtype_name(t) != s.dtype or list(t.shape) != s.shape:
            raise ValueError(
                f"{name}: got {dtype_name(t)} {list(t.shape)}, the manifest says {s.dtype} {s.shape}"
            )


def vllm_chunks(tensors: list[TensorSpec], buffer_bytes: int) -> list[tuple[int, int, int]]:
    """vLLM's packed transfer (``packed_tensor.py``): tensors as raw bytes, concatenated, a chunk closed after
    the tensor that takes it past ``buffer_bytes`` (so a chunk may exceed it) or at the end. (first, last,
    bytes) per chunk; both sides must cut alike or the broadcasts do not match."""
    out: list[tuple[int, int, int]] = []
    first, size = 0, 0
    for i, spec in enumerate(tensors):
        size += nbytes(spec)
        if size > buffer_bytes:
            out.append((first, i + 1, size))
            first, size = i + 1, 0
    if first < len(tensors):
        out.append((first, len(tensors), size))
    return out


def pack_bytes(
    first: int, last: int, tensors: list[torch.Tensor], device: torch.device | str = "cpu"
) -> torch.Tensor:
    return torch.cat(
        [t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors[first:last]]
    )


def unpack_bytes(
    first: int, last: int, buf: torch.Tensor, tensors: list[TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    at = 0
    for spec in tensors[first:last]:
        n = nbytes(spec)
        yield spec.name, buf[at : at + n].view(getattr(torch, spec.dtype)).view(spec.shape)
        at += n
    if at != buf.numel():
        raise ValueError(f"chunk of {buf.numel()} bytes holds {at}")

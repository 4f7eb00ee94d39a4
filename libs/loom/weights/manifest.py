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
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


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
        elems = n // max(1, torch.empty((), dtype=getattr(torch, spec.dtype)).element_size())
        if i > first and (spec.dtype != tensors[first].dtype or size + n > bucket_bytes):
            out.append(Bucket(first, i, tensors[first].dtype, numel))
            first, numel, size = i, 0, 0
        numel += elems
        size += n
    if first < len(tensors):
        out.append(Bucket(first, len(tensors), tensors[first].dtype, numel))
    return out


def pack(bucket: Bucket, tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """The bucket's tensors, flattened into one buffer of its dtype."""
    parts = [t.detach().reshape(-1) for t in tensors[bucket.first : bucket.last]]
    if len(parts) == 1:
        return parts[0].to(device).contiguous()
    return torch.cat([p.to(device) for p in parts])


def unpack(
    bucket: Bucket, buf: torch.Tensor, tensors: list[TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of ``buf`` (which they keep alive)."""
    at = 0
    for spec in tensors[bucket.first : bucket.last]:
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

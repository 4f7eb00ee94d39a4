"""The ``store`` transport: versions published to a JetStream object store, fetched by each worker on demand.

RollArt §5.2: the trainer puts a version in a store and goes on; rollout workers in another cluster fetch it
while they keep generating and pause only to switch. The store is NATS JetStream's object store, the bus Loom
already runs on (chunked, replicated across a cluster's servers, reachable wherever the bus is). Each bucket
of the version (``manifest.buckets``) is one object, ``<group>.<i>``; the reference carries the manifest and
the checksum of every bucket's bytes in order, so a fetch is checked end to end. The publisher keeps the
last ``keep`` versions (a worker restarting mid-run fetches the fleet's from there) and deletes older ones.

Mooncake's transfer engine and store, which RollArt itself uses, were the other candidate; README's "Moving
weights" says why the object store was chosen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping

import torch
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from loom.protocol import WeightsRef, subjects
from loom.weights import manifest

log = logging.getLogger(__name__)

__all__ = ["StorePublisher", "fetch"]

BUCKET = subjects.OBJ_WEIGHTS
# Chunks just under the bus's message size limit: fewer messages per byte than the object store's 128 KiB.
CHUNK = (1 << 20) - 4096


class _Into:
    """Where a fetched object's chunks land: a preallocated buffer, written in place."""

    def __init__(self, n: int) -> None:
        self.buf = bytearray(n)
        self.at = 0

    def write(self, data: bytes) -> int:
        end = self.at + len(data)
        if end > len(self.buf):
            raise ValueError(f"object longer than its bucket of {len(self.buf)} bytes")
        self.buf[self.at : end] = data
        self.at = end
        return len(data)


async def _open(js: JetStreamContext, bucket: str, create: bool) -> ObjectStore:
    if not create:
        return await js.object_store(bucket)
    try:
        return await js.object_store(bucket)
    except NotFoundError:
        return await js.create_object_store(
            bucket, config=ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE, max_bytes=-1)
        )


class StorePublisher:
    """The trainer's side: publish versions, keep the last ``keep``."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str = BUCKET,
        keep: int = 2,
        prefix: str = "w",
        bucket_bytes: int = manifest.DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.keep = keep
        self.prefix = prefix
        self.bucket_bytes = bucket_bytes
        self._published: deque[tuple[str, int]] = deque()

    async def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> WeightsRef:
        obs = await _open(self.js, self.bucket, create=True)
        specs = manifest.specs(state)
        tensors = list(state.values())
        group = f"{self.prefix}-v{version}"
        buckets = manifest.buckets(specs, self.bucket_bytes)
        running = 0
        for i, b in enumerate(buckets):
            buf = manifest.pack(b.first, b.last, tensors)
            running = manifest.crc(buf, running)
            data = buf.view(torch.uint8).numpy().tobytes()
            name = f"{group}.{i}"
            await obs.put(
                name, data, meta=ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=CHUNK))
            )
        self._published.append((group, len(buckets)))
        while len(self._published) > self.keep:
            old, n = self._published.popleft()
            for i in range(n):
                with contextlib.suppress(NotFoundError):
                    await obs.delete(f"{old}.{i}")
        return WeightsRef(
            "store",
            address=self.bucket,
            group=group,
            bucket_bytes=self.bucket_bytes,
            tensors=specs,
            checksum=manifest.checksum(running),
        )


async def fetch(js: JetStreamContext, ref: WeightsRef) -> dict[str, torch.Tensor]:
    """A worker's side: every bucket of ``ref`` from the store, checked against its checksum."""
    if ref.transport != "store" or not ref.address or not ref.group:
        raise ValueError("not a store reference: it needs the object store's bucket and the version's group")
    obs = await _open(js, ref.address, create=False)
    out: dict[str, torch.Tensor] = {}
    running = 0
    for i, b in enumerate(manifest.buckets(ref.tensors, ref.bucket_bytes)):
        dtype = getattr(torch, b.dtype)
        size = b.numel * dtype.itemsize
        into = _Into(size)
        try:
            await obs.get(f"{ref.group}.{i}", writeinto=into)  # type: ignore[arg-type]
        except NotFoundError as e:
            raise FileNotFoundError(f"weights {ref.group} bucket {i} is not in store {ref.address!r}") from e
        if into.at != size:
            raise ValueError(f"weights {ref.group} bucket {i}: {into.at} bytes, expected {size}")
        buf = (
            torch.frombuffer(into.buf, dtype=torch.uint8).view(dtype) if size else torch.empty(0, dtype=dtype)
        )
        running = manifest.crc(buf, running)
        out.update(manifest.unpack(b.first, b.last, buf, ref.tensors))
        await asyncio.sleep(0)
    if manifest.checksum(running) != ref.checksum:
        raise ValueError(
            f"weights {ref.group} fetched corrupt: {manifest.checksum(running)}, published {ref.checksum}"
        )
    return out

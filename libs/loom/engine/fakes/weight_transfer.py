"""The simulated servers' side of a weight broadcast: join the trainer's group as the real servers do and take
the tensors for real, over gloo (the simulator has no GPU), then check them.

SGLang (``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``)
joins at ``rank_offset + tp_rank`` under the group's name, through the rendezvous at ``master_address:
master_port``, and takes each request's tensors one broadcast each, or as one flattened bucket; vLLM
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``)
joins at ``rank_offset`` and takes one request's tensors packed (raw bytes in chunks cut by its rule) or one
broadcast each. A real vLLM joins on its own NCCL communicator; the simulator joins a gloo group built as
``loom.weights.collective`` builds every group. Each member checks what the requests name (lengths, dtypes,
shapes) and, against a Loom trainer, the CRC of every byte it took against the one the trainer published.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from loom.protocol import TensorSpec

if TYPE_CHECKING:
    from loom.weights.collective import Format

# torch and loom.weights.collective are imported where a broadcast is taken: `loom sim-server` starts without
# torch, as the services' images have none.

log = logging.getLogger(__name__)

DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"})
# How long a member waits for the trainer: to join, for each broadcast, for its checksum.
TIMEOUT_S = 300.0


def specs(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorSpec]:
    """The tensors a request names, checked as the servers check them (one dtype and shape per name)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    bad = sorted({d for d in dtypes if d not in DTYPES})
    if bad:
        raise ValueError(f"unknown dtypes {bad}")
    if any(d < 0 for s in shapes for d in s):
        raise ValueError("a shape has a negative dimension")
    return [TensorSpec(n, d, list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]  # type: ignore[arg-type]


class Member:
    """One server's place in a trainer's group, from joining to leaving."""

    def __init__(self, store: Any, pg: Any) -> None:
        self.store = store
        self.pg = pg
        self.running = 0  # CRC of the bytes taken so far
        self.bytes = 0
        self.tensors = 0

    @classmethod
    async def join(
        cls, address: str, port: int, rank: int, world_size: int, backend: str, name: str
    ) -> Member:
        if backend != "gloo":
            raise ValueError(f"the simulated server has no GPU: it joins over gloo, not {backend}")
        if not 1 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a receiver's in a group of {world_size}")

        from loom.weights import collective

        def build() -> Member:
            store = collective.connect(f"{address}:{port}", TIMEOUT_S)
            return cls(store, collective.join(store, rank, world_size, backend, TIMEOUT_S, name))

        return await asyncio.to_thread(build)

    async def take(self, tensors: list[TensorSpec], how: str, bucket_bytes: int = 0) -> None:
        """Receive ``tensors``: ``per_tensor`` (one broadcast each), ``flattened`` (one typed buffer) or
        ``vllm`` (packed chunks of ``bucket_bytes``)."""

        from loom.weights import collective

        if how == "flattened" and len({s.dtype for s in tensors}) > 1:
            raise ValueError("a flattened bucket holds tensors of one dtype")
        fmt: Format = {"per_tensor": "per_tensor", "vllm": "vllm"}.get(how, "buckets")  # type: ignore[assignment]
        size = bucket_bytes if how == "vllm" else 1 << 62  # a flattened request is one bucket

        def run() -> None:
            got, self.running = collective.take(self.pg, tensors, fmt, size, "cpu", self.running)
            self.tensors += len(got)
            self.bytes += sum(t.numel() * t.element_size() for t in got.values())

        await asyncio.to_thread(run)

    async def check(self) -> None:
        """Against a Loom trainer, which publishes its CRC after the last broadcast: the bytes taken match."""
        from loom.weights import collective

        await asyncio.to_thread(collective.verify, self.store, self.running, TIMEOUT_S)

    async def leave(self) -> None:
        from loom.weights import collective

        await asyncio.to_thread(collective.leave, self.pg)

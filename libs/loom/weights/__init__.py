"""Moving weights: one seam between the trainers that make versions and the rollout fleet that serves them.

A version travels by one of three transports (``WeightsRef.transport``):

- ``disk``: a Hugging Face checkpoint directory on a filesystem every worker reads.
- ``collective`` (``loom.weights.collective``): broadcast from the trainer over torch.distributed, NCCL on
  GPUs and gloo on CPUs, bucketed in the weights' own dtype; the fleet pauses (requests kept) while it
  arrives, as verl's and SkyRL's synchronous broadcasts do.
- ``store`` (``loom.weights.store``): published to the bus's object store without waiting; every worker
  fetches it while it generates and pauses only to switch (RollArt §5.2), for pools in another cluster.

The trainer side is ``loom.weights.publish`` (a ``Transport`` stages a version, then delivers it while the
scheduler moves the fleet); the worker side is ``Incoming``, handed to ``Engine.prepare_weights``: an engine
in the worker's process takes the tensors (``Incoming.tensors``), an engine behind a server passes the
reference to its server's own weight-transfer routes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loom.protocol import WeightsRef

if TYPE_CHECKING:  # the engine interface names these; the CLI imports it and must start without torch
    import torch
    from nats.js import JetStreamContext

__all__ = ["GROUP", "Incoming"]

# The name of every broadcast's group (SGLang's default one): each update has a rendezvous store of its own,
# so one name serves them all.
GROUP = "weight_update_group"


@dataclass(frozen=True)
class Incoming:
    """A version on its way to one worker: the reference the scheduler gave it (its rank set, for a
    collective), and what it needs to take it."""

    ref: WeightsRef
    js: JetStreamContext | None = None
    timeout_s: float = 600.0

    @classmethod
    def disk(cls, path: str | None) -> Incoming:
        return cls(WeightsRef("disk", path))

    @property
    def path(self) -> str | None:
        return self.ref.path if self.ref.transport == "disk" else None

    async def tensors(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The version's state dict, received (collective) or fetched (store); for a disk version, read from
        its checkpoint's safetensors."""
        ref = self.ref
        if ref.transport == "collective":
            from loom.weights import collective

            return await asyncio.to_thread(collective.receive, ref, self.timeout_s, device)
        if ref.transport == "store":
            from loom.weights import store

            if self.js is None:
                raise RuntimeError("a store version needs the bus's JetStream to fetch from")
            return await store.fetch(self.js, ref)
        if ref.path is None:
            raise ValueError("a disk version needs a checkpoint path")
        from loom.weights import disk

        return await asyncio.to_thread(disk.read, ref.path)

"""The trainer's side of moving weights: a ``Transport`` stages a version, then delivers it while the
scheduler moves the fleet (``StreamClient.update_weights``, ``loom.integrations``).

``stage`` makes the version available and returns its reference (disk: the checkpoint written; store: the
version published; collective: the group it will go out on). ``deliver`` runs beside the fleet update (the
collective broadcast; nothing for the others). ``abandon`` calls off a delivery whose update failed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from nats.js import JetStreamContext
from transformers import PreTrainedModel

from loom import checkpoints
from loom.protocol import WeightsRef, WeightTransport
from loom.weights.collective import Sender, Sent
from loom.weights.store import StorePublisher

__all__ = [
    "CollectiveTransport",
    "DiskTransport",
    "StoreTransport",
    "Transport",
    "deliver_during",
    "transport",
]

T = TypeVar("T")


# What a trainer hands over: its model, or the state dict it gathered (all ranks' shards, under FSDP or ZeRO-3).
Weights = torch.nn.Module | Mapping[str, torch.Tensor]


def state_of(model: Weights) -> dict[str, torch.Tensor]:
    """The weights to move: a model's state dict (tied weights under each of their names, as a checkpoint
    holds them), detached."""
    state = model if isinstance(model, Mapping) else model.state_dict()
    return {k: v.detach() for k, v in state.items()}


class Transport(Protocol):
    name: WeightTransport
    # Whether the workers may take the version while they generate (the fleet then pauses only to switch).
    while_generating: bool

    async def stage(self, version: int, model: Weights) -> WeightsRef: ...

    async def deliver(self, ref: WeightsRef, timeout_s: float) -> None: ...

    def abandon(self, ref: WeightsRef) -> None: ...

    async def close(self) -> None: ...


class _Staged:
    """A transport whose ``stage`` leaves the version where the workers take it themselves: nothing to
    deliver, nothing to call off."""

    while_generating = True

    async def deliver(self, ref: WeightsRef, timeout_s: float) -> None:
        return None

    def abandon(self, ref: WeightsRef) -> None:
        return None

    async def close(self) -> None:
        return None


class DiskTransport(_Staged):
    name: WeightTransport = "disk"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    async def stage(self, version: int, model: Weights) -> WeightsRef:
        if not isinstance(model, PreTrainedModel):
            raise TypeError(
                "the disk transport writes a Hugging Face checkpoint: it needs the PreTrainedModel"
            )
        path = await asyncio.to_thread(checkpoints.save, model, self.root / f"v{version}")
        return WeightsRef("disk", str(path))


class StoreTransport(_Staged):
    name: WeightTransport = "store"

    def __init__(self, js: JetStreamContext, keep: int = 2) -> None:
        self.publisher = StorePublisher(js, keep=keep)

    async def stage(self, version: int, model: Weights) -> WeightsRef:
        return await self.publisher.publish(version, state_of(model))


class CollectiveTransport:
    """Broadcast from this process as rank 0. The broadcast runs on a thread of its own (a daemon: one whose
    update failed after its group formed waits out the backend's timeout without holding up an exit)."""

    name: WeightTransport = "collective"
    # The fleet takes it inside the pause, as a synchronous broadcast does: the engines load in place.
    while_generating = False

    def __init__(self, sender: Sender | None = None) -> None:
        self.sender = sender or Sender()
        self._staged: dict[str, dict[str, torch.Tensor]] = {}
        self.last: Sent | None = None

    async def stage(self, version: int, model: Weights) -> WeightsRef:
        self.last = None  # what the next delivery sends
        state = state_of(model)
        ref = self.sender.ref(state)
        self._staged[ref.group] = state
        return ref

    async def deliver(self, ref: WeightsRef, timeout_s: float) -> None:
        state = self._staged.pop(ref.group)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Sent] = loop.create_future()

        def settle(sent: Sent | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(sent)  # type: ignore[arg-type]

        def run() -> None:
            try:
                sent = self.sender.send(ref, state, timeout_s)
            except BaseException as e:
                loop.call_soon_threadsafe(settle, None, e)
            else:
                loop.call_soon_threadsafe(settle, sent, None)

        threading.Thread(target=run, name=f"weights-{ref.group}", daemon=True).start()
        self.last = await done

    def abandon(self, ref: WeightsRef) -> None:
        self._staged.pop(ref.group, None)
        self.sender.cancel(ref)

    async def close(self) -> None:
        return None


def transport(
    name: WeightTransport,
    *,
    root: str | Path | None = None,
    js: JetStreamContext | None = None,
    sender: Sender | None = None,
) -> Transport:
    """The transport called ``name``: ``disk`` writes under ``root``, ``store`` publishes through ``js``,
    ``collective`` broadcasts through ``sender`` (a new one on this host's loopback when None)."""
    if name == "disk":
        if root is None:
            raise ValueError("the disk transport needs a directory to write checkpoints in")
        return DiskTransport(root)
    if name == "store":
        if js is None:
            raise ValueError("the store transport needs the bus's JetStream")
        return StoreTransport(js)
    if name == "collective":
        return CollectiveTransport(sender)
    raise ValueError(f"unknown weights transport {name!r}; one of disk, collective, store")


async def deliver_during(transport: Transport, ref: WeightsRef, timeout_s: float, update: Awaitable[T]) -> T:
    """Run ``update`` (the request that moves the fleet to ``ref``) while ``transport`` delivers ``ref``. An
    update that fails calls the delivery off; a delivery that fails fails the update too (the workers
    waiting on it fail their prepare, and the fleet is kept)."""
    delivery = asyncio.ensure_future(transport.deliver(ref, timeout_s))
    try:
        res = await update
    except BaseException:
        transport.abandon(ref)
        delivery.cancel()
        with contextlib.suppress(BaseException):
            await delivery
        raise
    await delivery
    return res

"""Loom's fleet takes verl's weights in memory: a checkpoint manager and a checkpoint-engine backend.

verl's trainer moves its rollout's weights through the manager named by
``actor_rollout_ref.rollout.checkpoint_manager_class`` (read by the PPO trainer under ``trainer.use_v1=false``
and by the separation trainer): it calls ``update_weights(global_steps)`` after every actor update (and once
at the start, at the step it resumed from). ``LoomCheckpointManager`` then has every actor rank run verl's
own ``update_weights`` with the ``loom`` backend, whose ``send_weights`` takes the actor's
``get_per_tensor_param()``: whole tensors under their Hugging Face names, on every rank (FSDP gathers each
shard, Megatron exports through Megatron-Bridge; every rank takes part in both). Rank 0 keeps them and moves
Loom's fleet to them as version ``global_steps`` (``loom.integrations.fleet``: a broadcast from that rank, all
or nothing); the others only take part in the gathering. ``save_freq`` and ``save_contents`` stay the
user's choice: no checkpoint is written for the fleet.

    trainer.use_v1=false
    actor_rollout_ref.rollout.checkpoint_manager_class=loom.integrations.verl.LoomCheckpointManager
    actor_rollout_ref.rollout.checkpoint_engine.backend=loom
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=loom.integrations.verl.checkpoint
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.loom.url=http://HOST:8080
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.loom.model=qwen3-tiny

The admin's token comes from ``LOOM_API_TOKEN`` in the actor workers' environment. ``host`` and ``advertise``
(engine kwargs) place rank 0's rendezvous where the fleet's workers reach it (default: this host's loopback).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from typing import Any

import ray
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.utils import ensure_async_iterator

from loom.integrations import fleet
from loom.integrations.jobs import connect
from loom.weights.collective import Sender
from loom.weights.publish import CollectiveTransport

BACKEND = "loom"
MANAGER = "loom.integrations.verl.LoomCheckpointManager"
_DRIVEN = (
    f"Loom's checkpoint engine is driven by {MANAGER} (Loom's fleet is not verl's rollout replicas): set "
    f"actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER} and trainer.use_v1=false (verl's v1 trainer "
    "builds its own manager and reads no checkpoint_manager_class)"
)


# What a Megatron actor hands a checkpoint engine its weights through: Megatron-Bridge's export to Hugging Face
# names (verl's MegatronEngine.get_per_tensor_param), run on megatron-core.
MEGATRON_NEEDS = (("megatron.core", "megatron-core"), ("megatron.bridge", "Megatron-Bridge"))


def in_memory(config: Any) -> bool:
    """Whether verl's config moves Loom's fleet through ``LoomCheckpointManager`` (the rollout then leaves
    verl's saved checkpoints alone). Checks at start what that needs of the actor: a Megatron actor exports
    through Megatron-Bridge, and without it (or megatron-core) nothing would reach the fleet."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.get("checkpoint_manager_class") != MANAGER:
        return False
    if config.trainer.get("use_v1", False):
        raise ValueError(_DRIVEN)
    model = config.actor_rollout_ref.model
    lora = model.get("lora") or {}
    if (model.get("lora_rank") or lora.get("rank") or 0) > 0 and not lora.get("merge", False):
        # verl's update_weights drops the adapter's config: the fleet would get base weights without it.
        raise ValueError(
            "Loom's fleet takes whole weights: with LoRA set actor_rollout_ref.model.lora.merge=true, so that "
            "verl folds the adapter into them before sending"
        )
    if config.actor_rollout_ref.actor.get("strategy") == "megatron":
        missing = [pkg for module, pkg in MEGATRON_NEEDS if not _importable(module)]
        if missing:
            raise RuntimeError(
                "Loom's checkpoint manager takes a Megatron actor's weights as Megatron-Bridge exports them "
                f"(Hugging Face names, verl's MegatronEngine.get_per_tensor_param); not installed: {', '.join(missing)}"
            )
    return True


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


@CheckpointEngineRegistry.register(BACKEND)
class LoomCheckpointEngine(CheckpointEngine):
    """The ``loom`` backend, built on every actor rank as verl builds backends (``is_master``: rank 0;
    ``bucket_size``: the broadcast's bucket, bytes)."""

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        url: str = "",
        model: str = "qwen3-tiny",
        token: str | None = None,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        # verl passes checkpoint_engine.engine_kwargs.loom as these keywords (an unknown one is a TypeError).
        if is_master and not url:
            raise ValueError(
                "Loom's checkpoint engine needs Loom's address: "
                "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.loom.url=http://HOST:8080"
            )
        self.is_master = is_master
        self.url, self.model, self.timeout_s = url, model, float(timeout_s)
        self.token = token or os.environ.get("LOOM_API_TOKEN", "")
        if is_master and not self.token:
            raise ValueError(
                "Loom's checkpoint engine needs the admin's token: set LOOM_API_TOKEN on the workers"
            )
        self.transport = (
            CollectiveTransport(Sender(host=host, advertise=advertise, bucket_bytes=int(bucket_size)))
            if is_master
            else None
        )

    def prepare(self) -> dict[str, Any]:
        raise RuntimeError(_DRIVEN)

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        raise RuntimeError(_DRIVEN)

    def init_process_group(self, **kwargs: Any) -> None:
        raise RuntimeError(_DRIVEN)

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Take every tensor of ``weights`` (every rank must: the gathering is a collective); on rank 0, move
        the fleet to them as version ``global_steps``. verl's metrics for the update, on rank 0."""
        t0 = time.perf_counter()
        state: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        async for name, tensor in ensure_async_iterator(weights):
            # Drained to the end whatever happens here: the other ranks are inside the same gathering.
            if self.is_master and error is None:
                try:
                    state[name] = tensor.detach().to("cpu", copy=True)
                except Exception as e:  # host memory, most likely
                    error, state = e, {}
        if error is not None:
            raise error
        if not self.is_master:
            return {}
        gathered = time.perf_counter()
        if not global_steps:
            # Step 0 of a fresh run: the fleet already serves the weights the actor starts from.
            return {"loom/gather_s": gathered - t0}
        async with connect(self.url, self.token) as http:
            serves = await fleet.push(
                http, self.model, int(global_steps), state, self.transport, self.timeout_s
            )
        sent = self.transport.last if self.transport is not None else None
        return {
            "loom/gather_s": gathered - t0,
            "loom/update_s": time.perf_counter() - gathered,
            "loom/bytes": float(sent.bytes) if sent is not None else 0.0,
            "loom/fleet_version": float(serves),
        }

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        raise RuntimeError("Loom's fleet receives through its own workers, not a verl rollout replica")


class LoomCheckpointManager(CheckpointEngineManager):
    """verl's checkpoint manager with Loom's fleet as the rollout: ``update_weights`` has every actor rank send
    through the ``loom`` backend. verl's own calls on its replicas (``sleep_replicas`` and the rest) stay
    verl's, for any rollout servers it started itself."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any] | None = None, **kwargs: Any) -> None:
        if getattr(config, "backend", None) != BACKEND:
            raise ValueError(
                f"{MANAGER} moves Loom's fleet through the {BACKEND!r} checkpoint engine, not "
                f"{getattr(config, 'backend', None)!r}: set actor_rollout_ref.rollout.checkpoint_engine.backend="
                f"{BACKEND} and .custom_backend_module=loom.integrations.verl.checkpoint"
            )
        super().__init__(config=config, actor_wg=actor_wg, replicas=list(replicas or []))

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        # Bound from the actor worker class at run time (verl's register), dispatched to every rank.
        refs = self.actor_wg.update_weights(global_steps=global_steps, mode=BACKEND)  # type: ignore[attr-defined]
        results = await asyncio.to_thread(ray.get, refs)
        metrics: dict[str, float] = {}
        for r in results:
            if isinstance(r, dict):
                metrics.update(r)
        return metrics

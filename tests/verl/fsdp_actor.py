"""An FSDP actor rank as verl's trainer runs one, on the CPU: a Ray actor holding a tiny Qwen3 sharded with
FSDP2 over gloo, its checkpoint engine built from verl's config as verl's worker builds it, and verl's own
``ActorRolloutRefWorker.update_weights`` and ``FSDPEngine.get_per_tensor_param`` run on it.

verl's engine assumes a GPU in two places that only log or place (``get_device_id``, ``log_gpu_memory_usage``):
on a CPU they are the CPU. Everything else that moves the weights is verl's code."""

from __future__ import annotations

import asyncio
import os
import types
from typing import Any

import torch

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}


class FSDPActorRank:
    def __init__(self, rank: int, world: int, port: int, checkpoint_engine: dict[str, Any]) -> None:
        import torch.distributed as dist
        from omegaconf import OmegaConf
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.import_utils import import_external_libs
        from verl.workers.config import CheckpointEngineConfig

        from loom import checkpoints as policy

        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
        )
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        self.rank = rank
        model = policy.build_tiny(seed=0, **SMALL)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        self.module = fully_shard(model, mesh=mesh)
        # verl's worker, step 4 of init_model: the checkpoint engine from rollout.checkpoint_engine.
        cfg = omega_conf_to_dataclass(OmegaConf.create(checkpoint_engine), CheckpointEngineConfig)
        import_external_libs(cfg.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            cfg.backend,
            is_master=(dist.get_rank() == 0),
            bucket_size=cfg.update_weights_bucket_megabytes << 20,
            **cfg.engine_kwargs.get(cfg.backend, {}),
        )
        self.config = types.SimpleNamespace(rollout=types.SimpleNamespace(checkpoint_engine=cfg))
        self.actor = types.SimpleNamespace(engine=self._engine())

    def _engine(self) -> Any:
        import verl.workers.engine.fsdp.transformer_impl as fsdp
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        fsdp.get_device_id = lambda: "cpu"
        fsdp.log_gpu_memory_usage = lambda *args, **kwargs: None
        engine = types.SimpleNamespace(
            module=self.module,
            _uses_fsdp2_cpu_offload_policy=False,
            _is_offload_param=False,
            _qat_enabled=False,
            model_config=types.SimpleNamespace(lora={}, hf_config=self.module.config),
            engine_config=None,
        )
        engine.get_per_tensor_param = types.MethodType(FSDPEngine.get_per_tensor_param, engine)
        return engine

    def train_step(self, seed: int) -> None:
        """What an optimizer step does to the weights: every shard moves (the same on every rank's view)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.module.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(0.01 * torch.randn(local.shape, generator=g))

    def full_state(self) -> dict[str, torch.Tensor]:
        gen, _ = self.actor.engine.get_per_tensor_param()
        return {k: v.detach().clone() for k, v in gen}

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        from verl.workers.engine_workers import ActorRolloutRefWorker

        return asyncio.run(ActorRolloutRefWorker.update_weights(self, global_steps=global_steps, mode=mode))  # type: ignore[arg-type]


class ActorGroup:
    """verl's actor worker group as its checkpoint manager uses it: ``update_weights`` dispatched to every rank
    (ONE_TO_ALL), answering with the ranks' futures."""

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> list[Any]:
        return [r.update_weights.remote(global_steps=global_steps, mode=mode) for r in self.ranks]

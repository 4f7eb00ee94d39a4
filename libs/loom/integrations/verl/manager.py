"""``LoomAgentLoopManager``: Loom as verl's rollout, in place of verl's agent-loop manager.

verl's PPO trainer loads the class named by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``, builds
it with ``create(config=..., llm_client=..., teacher_client=..., reward_loop_worker_handles=...)`` and calls
``generate_sequences(batch)`` for every training and validation batch. Here each call is one Loom job (a group
per distinct prompt, ``rollout.n`` samples each); the trajectories come back as the ``DataProto`` verl's own
manager returns (``loom.integrations.verl.batch``), Loom's reward in ``rm_scores``. Before the job, the fleet
moves to the newest checkpoint verl saved (``loom.integrations.verl.weights``), unless verl moves it in memory
after every update (``loom.integrations.verl.checkpoint``).

verl's sampling settings apply (``rollout.temperature``/``top_p``, ``val_kwargs`` for validation); its LLM
servers, reward workers and teacher are not used: Loom's fleet generates and Loom's reward scores.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl import DataProto
from verl.utils.ray_utils import auto_await

from loom.integrations.jobs import connect
from loom.integrations.verl.batch import to_dataproto
from loom.integrations.verl.client import run_job
from loom.integrations.verl.config import LoomConfig, loom_config
from loom.integrations.verl.jobs import plan
from loom.integrations.verl.samples import sample_of
from loom.integrations.verl.weights import weight_sync


def job_spec(
    loom: LoomConfig,
    name: str,
    tasks: list[dict[str, Any]],
    group_size: int,
    sampling: Mapping[str, Any],
    response_length: int,
) -> dict[str, Any]:
    """The Loom job of a batch. ``sampling``: verl's (``temperature``, ``top_p``; its ``top_k`` has no
    counterpart in Loom's engines' sampling)."""
    return {
        "name": name,
        "env": loom.env,
        "model": loom.model,
        "tasks": tasks,
        "group_size": group_size,
        "max_turns": loom.max_turns,
        "max_tokens": loom.max_tokens or response_length,
        "max_turn_tokens": loom.max_turn_tokens,
        # Loom records every sampled token's log-probability: verl's rollout correction reads them.
        "sampling": {
            "temperature": float(sampling["temperature"]),
            "top_p": float(sampling["top_p"]),
            "logprobs": True,
        },
        **loom.job,
    }


class LoomAgentLoopManager:
    def __init__(
        self,
        config: Any,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.loom = loom_config(config)
        self.rollout = config.actor_rollout_ref.rollout
        root = self.loom.checkpoints or config.trainer.default_local_dir
        # With Loom's checkpoint manager, verl moves the fleet itself after every update; else the fleet follows
        # the checkpoints verl saves.
        self.weights = weight_sync(config, Path(root), self.loom.model)

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> LoomAgentLoopManager:
        return cls(*args, **kwargs)

    @auto_await
    async def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One Loom job for the batch; its trajectories as verl's rollout output, row for row."""
        if not isinstance(prompts, DataProto):
            raise TypeError(
                "verl's v1 trainer (trainer.use_v1=true) hands its manager a TensorDict and reads TransferQueue: "
                "set trainer.use_v1=false, or run LoomAgentLoop under verl's own manager"
            )
        meta = prompts.meta_info
        if (
            "__do_sample__" in prompts.non_tensor_batch
            and not prompts.non_tensor_batch["__do_sample__"].all()
        ):
            raise NotImplementedError("greedy baseline rows (REMAX) in a Loom job: use another estimator")
        validate = bool(meta.get("validate", False))
        rows = len(prompts)
        p = plan(prompts.non_tensor_batch, rows, self.loom.dataset)
        name = f"verl {'validation' if validate else 'step'} {meta.get('global_steps', -1)}"
        response_length = int(self.rollout.response_length)
        sampling = self.rollout.val_kwargs if validate else self.rollout
        spec = job_spec(self.loom, name, p.tasks, p.group_size, sampling, response_length)
        start = time.perf_counter()
        async with connect(self.loom.url, self.loom.api_token()) as http:
            if self.weights is not None:
                await self.weights.sync(http)
            moved = time.perf_counter()
            trajs = await run_job(http, spec, self.loom.timeout_s)
        done = time.perf_counter()
        return to_dataproto(
            [sample_of(trajs[slot]) for slot in p.slots],
            int(self.rollout.prompt_length),
            response_length,
            self.loom.pad_token_id,
            non_tensor=prompts.non_tensor_batch,
            meta_info={"timing": {"loom/update_weights": moved - start, "loom/job": done - moved}},
        )

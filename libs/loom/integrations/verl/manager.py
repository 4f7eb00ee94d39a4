"""``LoomAgentLoopManager``: Loom as verl's rollout, in place of verl's agent-loop manager.

verl's PPO trainer loads the class named by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``, builds
it with ``create(config=..., llm_client=..., teacher_client=..., reward_loop_worker_handles=...)`` and calls
``generate_sequences(batch)`` for every training and validation batch. Here each call is one Loom job (a group
per distinct prompt, ``rollout.n`` samples each). The classic trainer (``trainer.use_v1=false``) hands over a
``DataProto`` with each prompt already repeated ``rollout.n`` times and gets back the ``DataProto`` verl's own
manager returns (``loom.integrations.verl.batch``); the v1 trainer (verl's default, in its ``sync`` mode) hands
over a ``TensorDict`` of distinct prompts and reads the samples from TransferQueue, where they are written as its
own manager writes them (``loom.integrations.verl.records``) before the call returns. Loom's reward is in
``rm_scores``. Before the job, the fleet moves to the newest checkpoint verl saved
(``loom.integrations.verl.weights``), unless verl moves it in memory after every update
(``loom.integrations.verl.checkpoint``, classic trainer only).

verl's sampling settings apply (``rollout.temperature``/``top_p``, ``val_kwargs`` for validation); its LLM
servers, reward workers and teacher are not used: Loom's fleet generates and Loom's reward scores.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensordict import TensorDict
from verl import DataProto
from verl.utils.ray_utils import auto_await
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from loom.integrations.jobs import connect
from loom.integrations.verl.batch import to_dataproto
from loom.integrations.verl.client import run_job
from loom.integrations.verl.config import LoomConfig, loom_config
from loom.integrations.verl.jobs import plan, task_of
from loom.integrations.verl.records import prompt_rows, record
from loom.integrations.verl.samples import sample_of
from loom.integrations.verl.weights import weight_sync

# verl's v1 trainers that a blocking rollout serves: the async ones keep verl's own replicas generating while
# they train, and resume what a weight update interrupted.
V1_MODES = ("sync",)


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
        trainer = config.trainer
        mode = trainer.get("v1", {}).get("trainer_mode", "sync")
        if trainer.get("use_v1", False) and mode not in V1_MODES:
            raise ValueError(
                f"Loom's manager runs a batch as one job and returns when it is done: verl's v1 trainer in "
                f"trainer_mode {mode} is not served; set trainer.v1.trainer_mode=sync (or trainer.use_v1=false)"
            )
        self.rollout = config.actor_rollout_ref.rollout
        root = self.loom.checkpoints or config.trainer.default_local_dir
        # With Loom's checkpoint manager, verl moves the fleet itself after every update; else the fleet follows
        # the checkpoints verl saves.
        self.weights = weight_sync(config, Path(root), self.loom.model)

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> LoomAgentLoopManager:
        return cls(*args, **kwargs)

    @auto_await
    async def generate_sequences(self, prompts: DataProto | TensorDict) -> DataProto | None:
        """One Loom job for the batch: under the classic trainer, its trajectories as verl's rollout output, row
        for row; under the v1 trainer, written to TransferQueue, nothing returned."""
        if isinstance(prompts, TensorDict):
            await self._to_transfer_queue(prompts)
            return None
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

    async def _to_transfer_queue(self, batch: TensorDict) -> None:
        """The v1 trainer's batch of distinct prompts: each a group of its ``rollout.n`` samples (or its row's
        ``__rollout_n__``), all of them written to TransferQueue, and each prompt's status, before returning."""
        validate = bool(batch["validate"]) if "validate" in batch else False
        partition = "val" if validate else "train"
        sampling = self.rollout.val_kwargs if validate else self.rollout
        rows = prompt_rows(batch)
        sizes = [int(row.pop("__rollout_n__", sampling.n)) for row in rows]
        greedy = [not row.pop("__do_sample__", True) for row in rows]  # verl samples validation as configured
        if any(greedy) and not validate:
            raise NotImplementedError("greedy baseline rows (REMAX) in a Loom job: use another estimator")
        uids = [str(row["uid"]) for row in rows]
        # verl's v1 trainer alone reads TransferQueue (an extra of verl's): the classic one needs none of it.
        import transfer_queue as tq

        await tq.async_kv_batch_put(
            keys=uids, partition_id=partition, tags=[{"status": "running"}] * len(uids)
        )
        try:
            name = f"verl {'validation' if validate else 'step'} {batch['global_steps']}"
            keys, fields, tags = await self._samples(name, rows, uids, sizes, sampling)
        except BaseException:
            # As verl's own worker marks a prompt whose sessions failed: its replay buffer stops waiting for it.
            await tq.async_kv_batch_put(
                keys=uids, partition_id=partition, tags=[{"status": "failure"}] * len(uids)
            )
            raise
        await tq.async_kv_batch_put(
            keys=keys, partition_id=partition, fields=list_of_dict_to_tensordict(fields), tags=tags
        )
        await tq.async_kv_batch_put(
            keys=uids, partition_id=partition, tags=[{"status": "finished"}] * len(uids)
        )

    async def _samples(
        self, name: str, rows: list[dict[str, Any]], uids: list[str], sizes: list[int], sampling: Any
    ) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
        """The prompts' samples as TransferQueue keys, fields and tags: one Loom job (``name``) per group size."""
        # A Loom job has one group size: prompts asking for different numbers of samples are a job each.
        jobs: dict[int, list[int]] = {}
        for i, n in enumerate(sizes):
            jobs.setdefault(n, []).append(i)
        response_length = int(self.rollout.response_length)
        specs = []
        for n, members in jobs.items():
            tasks = [task_of(rows[i], self.loom.dataset) for i in members]
            named = [{**t, "id": t["id"] or f"p{g}"} for g, t in enumerate(tasks)]
            specs.append(job_spec(self.loom, name, named, n, sampling, response_length))
        start = time.perf_counter()
        async with connect(self.loom.url, self.loom.api_token()) as http:
            if self.weights is not None:
                await self.weights.sync(http)
            # A job that fails stops the others: the step fails as a whole.
            async with asyncio.TaskGroup() as group:
                runs = [group.create_task(run_job(http, spec, self.loom.timeout_s)) for spec in specs]
            results = [r.result() for r in runs]
        seconds = time.perf_counter() - start
        prompt_length = int(self.rollout.prompt_length)
        keys, fields, tags = [], [], []
        for (n, members), trajs in zip(jobs.items(), results, strict=True):
            for g, i in enumerate(members):
                for session in range(n):
                    s = sample_of(trajs[(g, session)]).fit(prompt_length, response_length)
                    f, t = record(s, rows[i], session, seconds)
                    keys.append(f"{uids[i]}_{session}_0")
                    fields.append(f)
                    tags.append(t)
        return keys, fields, tags

"""TRL's ``rollout_func`` contract, met by a Loom job (``trl/trainer/grpo_trainer.py``, ``_generate``).

TRL calls ``rollout_func(prompts, trainer)`` with this process's slice of the generation batch, each prompt
``num_generations`` times in a row, and reads back one row per prompt, in order: ``prompt_ids``,
``completion_ids`` and ``logprobs`` (one per completion token); ``env_mask`` (1 for the model's tokens, 0 for
the environment's: TRL's ``tool_mask``) and every other key as a column its reward functions receive.

A trajectory is one sequence (``loom.trainer.grpo.flatten``): the prompt is its first call's context; the
completion is everything after it, the model's tokens as the engine produced them and the environment's as Loom
appended them, never decoded and encoded again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from loom.envs import registry
from loom.integrations import fleet
from loom.integrations.jobs import checked, collect, connect, slots
from loom.protocol import Trajectory
from loom.protocol.messages import TERMINAL_JOB_STATES
from loom.text.tokenizer import ENDOFTEXT
from loom.trainer.grpo import flatten


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]
    reward: float | None
    weight_version: str
    status: str


def rows_of(traj: Trajectory) -> Row:
    """A trajectory as TRL's row. A failed one (no usable ids) keeps its place with one masked pad token and
    no reward: TRL reads a reward of None as missing, not as 0."""
    # An engine that never moved reports its starting weights as "" (simulated) or "0" (transformers).
    versions = {s.weight_version or "0" for s in traj.steps}
    version = versions.pop() if len(versions) == 1 else ",".join(sorted(versions))
    try:
        flat = flatten(traj) if traj.status == "completed" else None
    except ValueError:
        flat = None
    if flat is None or not traj.steps or traj.steps[0].prompt_ids is None:
        prompt = traj.steps[0].prompt_ids if traj.steps and traj.steps[0].prompt_ids else [ENDOFTEXT]
        return Row(list(prompt), [ENDOFTEXT], [0.0], [0], None, version, traj.status)
    n = len(traj.steps[0].prompt_ids)
    ids, mask, lps = flat.ids.tolist(), flat.loss_mask.tolist(), flat.behaviour_logprobs.tolist()
    return Row(
        ids[:n],
        ids[n:],
        lps[n:],
        [int(m) for m in mask[n:]],
        traj.reward,
        version,
        traj.status,
    )


def loom_reward(completions: list[Any], loom_reward: list[float | None], **kwargs: Any) -> list[float | None]:
    """TRL reward function: the reward Loom scored each trajectory with (its ``loom_reward`` column)."""
    return list(loom_reward)


@dataclass
class LoomRollout:
    """A ``rollout_func`` for TRL's ``GRPOTrainer`` that runs each generation batch as a Loom job.

    ``env``: any Loom environment (built-in, ``module:Class``, ``reasoning_gym:<name>``...). A prompt is a task:
    a task id of ``dataset`` (a built-in set) or of a library's environment (which generates its tasks), a
    ``{"id": ..., "data": {...}}`` task, or text / chat messages handed to the environment as the task's
    ``prompt`` / ``messages``. ``model``: the fleet TRL trains (``loom up --model``).

    When the trainer's ``global_step`` has moved since the last call, the fleet moves to its weights, all or
    nothing, before the job starts; each row says which weights made it. Every process of the run takes
    part in gathering the whole model once (a collective under FSDP or ZeRO-3, which shard it), the main
    process moves the fleet and the others wait for it. ``weights``: ``collective`` broadcasts the tensors
    from the main process (``sender``: its rendezvous, by default on this host's loopback; a multi-node run
    gives ``loom.weights.collective.Sender(host, advertise=...)``), ``disk`` saves a checkpoint under
    ``checkpoints`` that every worker reads."""

    url: str
    token: str
    env: str
    model: str = "qwen3-tiny"
    dataset: str | None = None
    checkpoints: Path = Path("loom-checkpoints")
    max_turns: int = 4
    max_tokens: int = 256
    max_turn_tokens: int | None = None
    temperature: float = 1.0
    job: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 1800.0
    version: int = 0
    stale_rows: int = 0
    weights: Literal["collective", "disk"] = "collective"
    sender: Any = None  # loom.weights.collective.Sender
    weights_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.weights not in ("collective", "disk"):
            raise ValueError(f"weights moves by collective or disk, not {self.weights!r}")
        self.http = httpx.Client(
            base_url=self.url, timeout=60.0, headers={"Authorization": f"Bearer {self.token}"}
        )
        self._transport: Any = None

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        self.sync_weights(trainer)  # first: every process takes part, whatever its own prompts hold
        groups = self._groups(prompts, trainer)
        spec = {
            "name": f"trl step {trainer.state.global_step}",
            "env": self.env,
            "model": self.model,
            "tasks": [self._task(p, i) for i, p in enumerate(groups)],
            "group_size": len(prompts) // len(groups),
            "max_turns": self.max_turns,
            "max_tokens": self.max_tokens,
            "max_turn_tokens": self.max_turn_tokens,
            "sampling": {"temperature": self.temperature, "logprobs": True},
            **self.job,
        }
        rows = self.run(spec)
        current = str(self.version)
        stale = sum(r.weight_version != current for r in rows)
        if stale:
            # Made by other weights than the trainer's (a fleet moved by someone else, a mid-job update):
            # reported, and trained on only through LoomGRPOTrainer's importance correction.
            self.stale_rows += stale
            if not getattr(trainer, "corrects_off_policy", False):
                for r in rows:
                    if r.weight_version != current:
                        r.env_mask = [0] * len(r.env_mask)
        return {
            "prompt_ids": [r.prompt_ids for r in rows],
            "completion_ids": [r.completion_ids for r in rows],
            "logprobs": [r.logprobs for r in rows],
            "env_mask": [r.env_mask for r in rows],
            "loom_reward": [r.reward for r in rows],
            "loom_weight_version": [r.weight_version for r in rows],
            "loom_status": [r.status for r in rows],
        }

    def run(self, spec: dict[str, Any]) -> list[Row]:
        """Submit the job, wait for it, and return its trajectories as rows in (group, sample) order."""
        job = checked(self.http.post("/v1/jobs", json=spec))
        deadline = time.monotonic() + self.timeout_s
        while job["state"] not in TERMINAL_JOB_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Loom job {job['id']} did not finish in {self.timeout_s:.0f} s")
            time.sleep(0.2)
            job = checked(self.http.get(f"/v1/jobs/{job['id']}"))
        with self.http.stream("GET", f"/v1/jobs/{job['id']}/trajectories", params={"format": "ndjson"}) as r:
            if r.status_code >= 400:
                r.read()
                checked(r)
            trajs = collect(job, spec, r.iter_lines())
        return [rows_of(trajs[k]) for k in slots(spec)]

    def sync_weights(self, trainer: Any) -> None:
        """Move the fleet to the trainer's weights when they changed since the last call. Every process calls
        it (TRL calls ``rollout_func`` on each with its slice of the batch)."""
        step = int(trainer.state.global_step)
        if step == self.version:
            return
        acc = trainer.accelerator
        # Under FSDP or ZeRO-3 this is a collective: every rank gives its shards, the main process gets them all.
        # DeepSpeed gathers through its engine, which transformers keeps as model_wrapped (trainer.model is the
        # bare module there).
        state = acc.get_state_dict(getattr(trainer, "model_wrapped", None) or trainer.model)
        error, interrupted = None, None
        if acc.is_main_process:
            try:
                asyncio.run(self._push(step, acc.unwrap_model(trainer.model), state))
            except BaseException as e:  # the others hear of it first, then it goes on up
                error, interrupted = f"{type(e).__name__}: {e}", e
        if acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            # The others wait here for the main process, and learn whether the fleet moved.
            error = broadcast_object_list([error], from_process=0)[0]
        if interrupted is not None and not isinstance(interrupted, Exception):
            raise interrupted
        if error is not None:
            raise RuntimeError(f"moving Loom's fleet of {self.model} to step {step} failed: {error}")
        self.version = step

    async def _push(self, step: int, model: Any, state: dict[str, Any]) -> None:
        async with connect(self.url, self.token) as http:
            if self.weights == "disk":
                path = (self.checkpoints / f"v{step}").resolve()
                await asyncio.to_thread(
                    model.save_pretrained, path, state_dict=state, safe_serialization=True
                )
                await fleet.push(http, self.model, step, path, timeout_s=self.weights_timeout_s)
                return
            if self._transport is None:
                from loom.weights.publish import CollectiveTransport

                self._transport = CollectiveTransport(self.sender)
            await fleet.push(http, self.model, step, state, self._transport, self.weights_timeout_s)

    def close(self) -> None:
        self.http.close()

    def _groups(self, prompts: list[Any], trainer: Any) -> list[Any]:
        g = int(trainer.args.num_generations if trainer.model.training else trainer.num_generations_eval or 1)
        if g < 1 or len(prompts) % g:
            raise ValueError(f"{len(prompts)} prompts are not groups of num_generations = {g}")
        groups = prompts[::g]
        for i, p in enumerate(groups):
            if any(q != p for q in prompts[i * g : (i + 1) * g]):
                raise ValueError("TRL's prompts come num_generations times in a row; these do not")
        return groups

    def _task(self, prompt: Any, i: int) -> dict[str, Any]:
        if isinstance(prompt, dict) and "id" in prompt:
            return {"id": str(prompt["id"]), "data": dict(prompt.get("data", {}))}
        if isinstance(prompt, str) and self.dataset is not None:
            return {"id": prompt, "data": {"set": self.dataset}}
        if isinstance(prompt, str) and registry.resolve(self.env).library() is not None:
            # A library's environment generates its own tasks: a prompt names one by its id, as its dataset does.
            return {"id": prompt, "data": {}}
        if isinstance(prompt, str):
            return {"id": f"p{i}", "data": {"prompt": prompt}}
        if isinstance(prompt, Sequence):
            return {"id": f"p{i}", "data": {"messages": list(prompt)}}
        raise TypeError(f"a prompt is a task id, a task dict, text or chat messages, not {type(prompt)}")

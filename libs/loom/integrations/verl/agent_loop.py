"""``LoomAgentLoop``: one verl sample as one Loom trajectory, for a trainer that keeps verl's agent-loop manager.

verl's ``AgentLoopWorker`` builds the loop a sample's ``agent_name`` names, calls ``run(sampling_params,
**columns)`` and pads what it returns. This loop runs the sample's task in Loom (its ``loom_task`` column, else
its ``raw_prompt``) and returns the trajectory as verl's ``AgentLoopOutput``, Loom's reward as ``reward_score``
(so verl's reward loop leaves it be). It is registered as ``loom``; verl's workers are Ray actors, which learn
of it from the file ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` names:

    - name: loom
      _target_: loom.integrations.verl.LoomAgentLoop

Settings come from the config's ``loom`` section; keys of that entry (``env: coin``) override them for the loop.
A loop sees one sample, so each is a Loom job of one trajectory: Loom schedules them without knowing their
groups, which ``LoomAgentLoopManager`` (a batch as one job) gives it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from loom.integrations.jobs import connect
from loom.integrations.verl.batch import extra_fields
from loom.integrations.verl.client import run_job
from loom.integrations.verl.config import LoomConfig, loom_config
from loom.integrations.verl.jobs import task_of
from loom.integrations.verl.manager import job_spec
from loom.integrations.verl.samples import Sample, sample_of
from loom.integrations.verl.weights import WeightSync, weight_sync

# verl builds a loop per sample: what the fleet was moved to lives per process, by (url, model, checkpoints).
_WEIGHTS: dict[tuple[str, str, str], WeightSync | None] = {}


@register("loom")
class LoomAgentLoop(AgentLoopBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in LoomConfig.__struct_fields__}
        super().__init__(*args, **kwargs)
        self.loom = loom_config(self.config, **overrides)
        root = str(self.loom.checkpoints or self.config.trainer.default_local_dir)
        key = (self.loom.url, self.loom.model, root)
        if key not in _WEIGHTS:
            _WEIGHTS[key] = weight_sync(self.config, Path(root), self.loom.model)
        self.weights = _WEIGHTS[key]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = task_of(kwargs, self.loom.dataset)
        response_length = int(self.rollout_config.response_length)
        spec = job_spec(
            self.loom,
            f"verl sample {kwargs.get('index', '')}".strip(),
            [{**task, "id": task["id"] or "p0"}],
            1,
            {
                "temperature": sampling_params.get("temperature", 1.0),
                "top_p": sampling_params.get("top_p", 1.0),
            },
            response_length,
        )
        start = time.perf_counter()
        async with connect(self.loom.url, self.loom.api_token()) as http:
            if self.weights is not None:
                await self.weights.sync(http)
            trajs = await run_job(http, spec, self.loom.timeout_s)
        s = sample_of(trajs[(0, 0)]).fit(int(self.rollout_config.prompt_length), response_length)
        return agent_loop_output(s, time.perf_counter() - start)


def agent_loop_output(s: Sample, seconds: float) -> AgentLoopOutput:
    """A sample (cut to verl's widths) as verl's agent loops return one; Loom's reward as ``reward_score``."""
    return AgentLoopOutput(
        prompt_ids=s.prompt_ids,
        response_ids=s.response_ids,
        response_mask=s.response_mask,
        response_logprobs=s.response_logprobs,
        reward_score=s.score,
        num_turns=s.num_turns,
        metrics=AgentLoopMetrics(generate_sequences=seconds),
        extra_fields=extra_fields(s),
    )

"""What every per-trajectory loop is given by its manager, and the pieces every loop shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from prometheus_client import Counter, Histogram

from loom.clock import Clock
from loom.engine.token_ids import seed63
from loom.protocol import GenRequest, GenResult, SamplingParams, Step, Trajectory, TrajStatus, TrajWork
from loom.runtime.genclient import GenClient
from loom.runtime.workers import ContextLimits


class TrajectoryAborted(Exception):
    """The engine aborted a generation (job cancelled, worker lost): the trajectory ends, unscored."""


@dataclass
class EnvMetrics:
    reset_s: Histogram
    step_s: Histogram
    failures: Counter


@dataclass
class LoopContext:
    nc: NATS
    clock: Clock
    gen: GenClient
    predict_timeout_s: float
    metrics: EnvMetrics | None = None
    limits: ContextLimits | None = None  # the fleet's context limit per model; None: unbounded


# A trajectory whose context has no room left for one more token under the engines' limit ends with this.
CONTEXT_FULL = "max_context"


async def context_room(
    ctx: LoopContext, work: TrajWork, context_len: int, scored: bool = False
) -> int | None:
    """Tokens the next call of a trajectory whose context is ``context_len`` long may generate within the
    engines' context limit (both vLLM and SGLang refuse a prompt that leaves no room), None when unbounded. A
    ``scored`` (forced) reply goes to the engine as part of the prompt, with one token to sample after it."""
    limit = await ctx.limits.of(work.model) if ctx.limits is not None else None
    return None if limit is None else limit - context_len - scored


def trajectory(
    work: TrajWork,
    status: TrajStatus,
    finish_reason: str,
    steps: list[Step],
    started: float,
    finished: float,
    info: dict[str, Any],
) -> Trajectory:
    """The trajectory record of a work item, as every loop and the manager's failure path write it."""
    return Trajectory(
        job_id=work.job_id,
        traj_id=work.traj_id,
        task_id=work.task.id,
        group=work.group,
        sample=work.sample,
        env=work.env,
        status=status,
        finish_reason=finish_reason,
        steps=steps,
        started_at=started,
        finished_at=finished,
        info=info,
    )


@dataclass(frozen=True)
class ModelCall:
    """One LLM call of a trajectory, done: what was asked, what came back, and when."""

    req: GenRequest
    res: GenResult
    started: float
    gen_s: float

    def step(
        self,
        action: str,
        observation: str,
        tool_s: float,
        prompt_ids: list[int] | None = None,
        output_ids: list[int] | None = None,
        rebased: bool = False,
    ) -> Step:
        return Step(
            index=self.req.step,
            prompt_len=self.req.input_len,
            output_len=self.res.output_len,
            action=action,
            observation=observation,
            worker_id=self.res.worker_id,
            started_at=self.started,
            queue_s=self.res.queue_s,
            gen_s=self.gen_s,
            tool_s=tool_s,
            attempts=self.req.attempt,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            output_logprobs=self.res.output_logprobs,
            finish_reason=self.res.finish_reason,
            cached_tokens=self.res.cached_tokens,
            weight_version=self.res.weight_version,
            rebased=rebased,
        )


def call_seed(traj_seed: int, step: int, sample: int = 0) -> int:
    """A model call's sampling seed (``SamplingParams.seeded``): its trajectory's seed (the job's seed, group
    and sample), turn and sample, hashed so that neighbouring calls draw far apart."""
    return seed63(f"{traj_seed}:{step}:{sample}")


async def call_model(
    ctx: LoopContext,
    work: TrajWork,
    step: int,
    input_len: int,
    max_new_tokens: int,
    priority: float,
    input_ids: list[int] | None = None,
    sampling: SamplingParams | None = None,
    *,
    sample: int = 0,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    top_logprobs: int = 0,
    forced_ids: list[int] | None = None,
) -> ModelCall:
    """Generate through the router; an engine abort ends the trajectory (TrajectoryAborted).

    ``ignore_eos`` when no token ids are sent or the reply is forced: a lengths-only call (a replay) and a
    scripted reply (``forced_ids``, scored by the engine as its output) must produce exactly the tokens they
    stand for. ``sample`` > 0 names another sample of the same call (an
    external agent's ``n``): a request of its own, ``rid`` suffixed ``.s<sample>``."""
    t0 = ctx.clock.now()
    sampling = sampling or work.sampling
    rid = f"{work.job_id}.{work.traj_id}.{step}" + (f".s{sample}" if sample else "")
    req = GenRequest(
        rid=rid,
        job_id=work.job_id,
        traj_id=work.traj_id,
        step=step,
        input_len=max(1, input_len),
        max_new_tokens=max(1, max_new_tokens),
        input_ids=input_ids,
        ignore_eos=input_ids is None or forced_ids is not None,
        priority=priority,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        return_logprob=sampling.logprobs,
        tag=work.tag,
        stop=stop or None,
        stop_token_ids=stop_token_ids or None,
        top_logprobs=top_logprobs,
        forced_ids=forced_ids,
        seed=call_seed(work.seed, step, sample) if sampling.seeded else None,
    )
    res = await ctx.gen.generate(req)
    if res.finish_reason == "abort":
        raise TrajectoryAborted(f"step {step} aborted by the engine")
    return ModelCall(req, res, t0, ctx.clock.now() - t0)

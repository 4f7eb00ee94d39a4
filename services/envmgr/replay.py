"""The per-trajectory loop for trace replay: generate, run the tool, predict while it runs, repeat."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from loom.bus import request
from loom.clock import Clock
from loom.envs.replay import ReplayEnv
from loom.genclient import GenClient
from loom.predict import context as predict_context
from loom.protocol import (
    GenRequest,
    Prediction,
    PredictRequest,
    PriorityUpdate,
    Step,
    Trajectory,
    TrajWork,
    encode,
    subjects,
)
from loom.traces import load_traces

log = logging.getLogger(__name__)


class TrajectoryAborted(Exception):
    pass


@dataclass
class LoopContext:
    nc: NATS
    clock: Clock
    gen: GenClient
    predict_timeout_s: float


async def run_replay(work: TrajWork, ctx: LoopContext) -> Trajectory:
    path = work.task.data.get("traces_path")
    trace_id = work.task.data["trace_id"]
    trace = load_traces(path)[trace_id]
    env = ReplayEnv(trace, work.tool_latency, work.seed, work.max_turns, work.max_tokens)
    calls = env.calls()
    actions, observations = [c.action for c in calls], [c.observation for c in calls]
    started = ctx.clock.now()
    steps: list[Step] = []
    generated = 0
    priority = 0.0
    for k, call in enumerate(calls):
        t0 = ctx.clock.now()
        req = GenRequest(
            rid=f"{work.job_id}.{work.traj_id}.{k}",
            job_id=work.job_id,
            traj_id=work.traj_id,
            step=k,
            input_len=call.input_len,
            max_new_tokens=call.max_new_tokens,
            ignore_eos=True,
            priority=priority,
        )
        res = await ctx.gen.generate(req)
        if res.finish_reason == "abort":
            raise TrajectoryAborted(f"step {k} aborted by the engine")
        gen_s = ctx.clock.now() - t0
        generated += res.output_len
        tool_s = 0.0
        if not call.last:
            tool_s = env.sample_tool_latency()
            # The prediction runs during the tool call so that its latency hides behind it; it reads the
            # context so far, this call's action included, its observation not yet.
            pieces = predict_context.step_pieces(actions, observations, k + 1)
            pred = asyncio.create_task(
                _predict(ctx, work, k + 1, call.input_len + res.output_len, generated, trace.task, pieces)
            )
            await ctx.clock.sleep(tool_s)
            context = call.input_len + res.output_len
            priority = await _await_prediction(ctx, work, k, pred, priority, context, generated)
        steps.append(
            Step(
                index=k,
                prompt_len=call.input_len,
                output_len=res.output_len,
                action=call.action,
                observation="" if call.last else call.observation,
                worker_id=res.worker_id,
                started_at=t0,
                queue_s=res.queue_s,
                gen_s=gen_s,
                tool_s=tool_s,
                attempts=req.attempt,
            )
        )
    return Trajectory(
        job_id=work.job_id,
        traj_id=work.traj_id,
        task_id=work.task.id,
        group=work.group,
        sample=work.sample,
        env=work.env,
        status="completed",
        finish_reason=env.finish_reason(len(calls)),
        steps=steps,
        started_at=started,
        finished_at=ctx.clock.now(),
        info={"trace_id": trace_id, "traces_path": path},
    )


async def _predict(
    ctx: LoopContext,
    work: TrajWork,
    step: int,
    context_len: int,
    generated: int,
    prompt: str,
    pieces: list[str],
) -> Prediction:
    """The predictor's estimate after ``step`` model calls (step 0 is the prompt alone, at admission)."""
    req = PredictRequest(
        work.job_id,
        work.traj_id,
        work.task.id,
        step,
        context_len,
        generated,
        prompt=predict_context.clip_prompt(prompt),
        pieces=predict_context.clip_pieces(pieces),
    )
    return await request(ctx.nc, subjects.PREDICT, req, Prediction, timeout_s=ctx.predict_timeout_s)


async def _await_prediction(
    ctx: LoopContext,
    work: TrajWork,
    step: int,
    pred: asyncio.Task[Prediction],
    priority: float,
    context_len: int,
    generated: int,
) -> float:
    try:
        p = await asyncio.wait_for(pred, ctx.predict_timeout_s)
    except Exception as e:  # a missing prediction never stalls a trajectory
        if not pred.done():
            pred.cancel()
            with contextlib.suppress(BaseException):
                await pred
        log.debug("no prediction for %s step %d: %s", work.traj_id, step, e)
        return priority
    # Longest predicted trajectory first (Heddle Algorithm 1, line 3: priority = the predicted length, which
    # stays put as a trajectory progresses; its remaining work would shrink and let fresh ones overtake it).
    total = float(generated) + p.remaining_tokens
    upd = PriorityUpdate(
        work.job_id,
        work.traj_id,
        total,
        p.remaining_tokens,
        step,
        context_len=context_len,
        generated_tokens=generated,
        method=p.method,
    )
    await ctx.nc.publish(subjects.CONTROL_PRIORITY, encode(upd))
    return total

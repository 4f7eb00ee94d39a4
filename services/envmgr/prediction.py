"""Predictions during a tool call: ask the predictor, publish the estimate as the trajectory's priority."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from loom.policies.ordering import held
from loom.predict import context as predict_context
from loom.protocol import Prediction, PredictRequest, PriorityUpdate, TrajWork, encode, subjects
from loom.runtime.bus import request
from services.envmgr.context import LoopContext

log = logging.getLogger(__name__)


async def predict(
    ctx: LoopContext,
    work: TrajWork,
    step: int,
    context_len: int,
    generated: int,
    prompt: str,
    pieces: list[str],
    prompt_tokens: int = 0,
) -> Prediction:
    """The predictor's estimate after ``step`` model calls (step 0 is the prompt alone, at admission);
    ``prompt_tokens``: the first call's input, where known."""
    req = PredictRequest(
        work.job_id,
        work.traj_id,
        work.task.id,
        step,
        context_len,
        generated,
        prompt=predict_context.clip_prompt(prompt),
        pieces=predict_context.clip_pieces(pieces),
        group=work.group,
        prompt_tokens=prompt_tokens,
        workload=str(work.task.data.get("workload", "")),
    )
    return await request(ctx.nc, subjects.PREDICT, req, Prediction, timeout_s=ctx.predict_timeout_s)


async def await_prediction(
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
    # The router keeps the longest (``held``); so do the requests, for a router that takes over without it.
    return held(priority, total)

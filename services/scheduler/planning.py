"""A job's initial placement plan: presorted DP on predicted lengths (Heddle), round robin, or none
(the per-request baselines decide in the router)."""

from __future__ import annotations

import asyncio
import logging
import math

from loom.data.traces import TraceError, load_traces
from loom.policies.affinity import eligible
from loom.policies.partition import coarsen, presorted_dp
from loom.policies.placement import RoundRobinPlacement
from loom.policies.profiles import placement_profile, placement_weights, tool_seconds
from loom.predict import context as predict_context
from loom.predict.history import HistoryPredictor
from loom.protocol import Job, Placement, Prediction, PredictRequest, TrajWork, WorkerInfo, subjects
from loom.runtime.bus import request
from loom.runtime.service import Runtime

log = logging.getLogger(__name__)


async def initial_predictions(
    rt: Runtime, job: Job, works: list[TrajWork], timeout_s: float = 2.0
) -> tuple[dict[str, float], float]:
    """Prompt-only estimate of each trajectory's total length, and the predictor's error (log sd): one
    predictor call per prompt (every sample of a group shares it); the history prior where the predictor
    does not answer. Estimates closer than the error tie (``partition.coarsen``)."""
    prior = HistoryPredictor().prior_total
    sem = asyncio.Semaphore(64)

    async def one(w: TrajWork) -> tuple[str, float, float, float]:
        prompt = int(w.task.data.get("prompt_tokens", 0) or 0)
        req = PredictRequest(
            job.id,
            w.traj_id,
            w.task.id,
            0,
            prompt,
            0,
            prompt=prompt_text(w),
            prompt_tokens=prompt,
            workload=str(w.task.data.get("workload", "")),
        )
        async with sem:
            try:
                p = await request(rt.nc, subjects.PREDICT, req, Prediction, timeout_s=timeout_s)
                return w.task.id, p.total_tokens, p.log_sd, p.slope
            except Exception as e:
                log.debug("no initial prediction for %s: %s", w.task.id, e)
                return w.task.id, prior, 0.0, 1.0

    firsts = {w.task.id: w for w in works}
    answers = await asyncio.gather(*(one(w) for w in firsts.values()))
    tasks = [a[0] for a in answers]
    log_sd = max((a[2] for a in answers), default=0.0)
    totals = coarsen([a[1] for a in answers], log_sd, min((a[3] for a in answers), default=1.0))
    by_task = dict(zip(tasks, totals, strict=True))
    return {w.traj_id: by_task[w.task.id] for w in works}, log_sd


def prompt_text(w: TrajWork) -> str:
    """The task statement a prompt-only prediction reads: the task's own ``prompt``, else its trace's."""
    data = w.task.data
    text = data.get("prompt")
    if isinstance(text, str):
        return predict_context.clip_prompt(text)
    trace_id = data.get("trace_id")
    if not isinstance(trace_id, str):
        return ""
    try:
        trace = load_traces(data.get("traces_path"))[trace_id]
    except (TraceError, KeyError):
        return ""
    return predict_context.clip_prompt(trace.task)


async def plan(
    rt: Runtime, job: Job, works: list[TrajWork], workers: dict[str, WorkerInfo], rr: RoundRobinPlacement
) -> Placement:
    """The job's placement; under a hardware affinity, each set of trajectories on the workers its tag may
    use, planned apart (and without migration between them: a plan's migration order spans one set)."""
    affinity = job.spec.hw_affinity
    if not affinity or not workers:
        return await _plan_on(rt, job, works, workers, rr)
    names = sorted(workers)
    gpus = [workers[n].gpu for n in names]
    parts: dict[tuple[int, ...], list[TrajWork]] = {}
    for w in works:
        parts.setdefault(tuple(eligible(gpus, affinity, w.tag)), []).append(w)
    if len(parts) == 1:
        (only,) = parts
        return await _plan_on(rt, job, works, {names[i]: workers[names[i]] for i in only}, rr)
    merged = Placement(job.id, {})
    for idx, subset in parts.items():
        p = await _plan_on(rt, job, subset, {names[i]: workers[names[i]] for i in idx}, rr)
        merged.assignments.update(p.assignments)
        merged.predicted.update(p.predicted)
    return merged


async def _plan_on(
    rt: Runtime, job: Job, works: list[TrajWork], workers: dict[str, WorkerInfo], rr: RoundRobinPlacement
) -> Placement:
    policy = job.spec.policy.resolved()
    if policy.placement == "round_robin":
        return Placement(job.id, rr.place([w.traj_id for w in works], list(workers)))
    if policy.placement != "presorted_dp":
        return Placement(job.id, {})
    preds, log_sd = await initial_predictions(rt, job, works)
    # Sample-major order: where predictions tie (prompts whose estimates are closer than the predictor's
    # error) the stable presort deals their samples across workers instead of stacking a prompt's samples,
    # whose real lengths are correlated, on one.
    order = sorted(works, key=lambda w: (w.sample, w.group))
    ids = [w.traj_id for w in order]
    names = sorted(workers)
    predicted = [preds[t] for t in ids]
    prompts = [float(w.task.data.get("prompt_tokens", 0) or 0) for w in order]
    # As the harness weighs them: a trajectory counts in a group by the KV cache it holds (its mean context
    # over the profiles' reference context), and brings its prompt to prefill and its predicted calls' tool
    # seconds, which no worker shortens. Its mean context here is its prompt and half its predicted output:
    # a task need not say its prompt's length, and the output alone still sizes the profiles' context.
    context, weights = placement_weights([p + t / 2 for p, t in zip(prompts, predicted, strict=True)])
    tool_s = job.spec.tool_latency.mean_s
    tools = [tool_seconds(t, tool_s) for t in predicted]
    try:
        profiles = [
            placement_profile(
                workers[n].model,
                workers[n].gpu,
                workers[n].tp,
                context_len=context,
                max_running=workers[n].max_running,
                tool_s=tool_s,
                max_group=math.ceil(sum(weights)) + 1,
            )
            for n in names
        ]
    except (KeyError, ValueError) as e:
        # Hardware the performance model does not know (a CPU engine, an unlisted GPU): no profile to
        # partition by, so the plan deals trajectories round robin and says why.
        log.warning("job %s: no performance profile (%s); placing round robin", job.id, e)
        return Placement(job.id, rr.place([w.traj_id for w in works], list(workers)))
    # Under the predictor's error, of the placements it cannot tell from the optimum, the least packed (as
    # the harness places and the allocator prices).
    part = presorted_dp(
        predicted,
        profiles,
        weights=weights,
        prefill=prompts,
        tool=tools,
        spread=log_sd > 0,
        slack=math.exp(log_sd),
    )
    assignment = part.assignment()
    return Placement(
        job.id,
        {t: names[int(assignment[i])] for i, t in enumerate(ids)},
        predicted=preds,
        groups=[names[i] for i in part.group_order],
        sizes=[part.bounds[i][1] - part.bounds[i][0] for i in part.group_order],
    )

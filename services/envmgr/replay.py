"""The per-trajectory loop for trace replay: generate, run the tool, predict while it runs, repeat."""

from __future__ import annotations

import asyncio

from loom.envs.replay import ReplayEnv
from loom.predict import context as predict_context
from loom.protocol import GenRequest, Step, Trajectory, TrajWork
from loom.traces import load_traces
from services.envmgr.context import LoopContext, TrajectoryAborted, trajectory
from services.envmgr.prediction import await_prediction, predict


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
                predict(ctx, work, k + 1, call.input_len + res.output_len, generated, trace.task, pieces)
            )
            await ctx.clock.sleep(tool_s)
            context = call.input_len + res.output_len
            priority = await await_prediction(ctx, work, k, pred, priority, context, generated)
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
    return trajectory(
        work,
        "completed",
        env.finish_reason(len(calls)),
        steps,
        started,
        ctx.clock.now(),
        {"trace_id": trace_id, "traces_path": path},
    )

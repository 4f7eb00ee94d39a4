"""The per-trajectory loop for trace replay: generate, run the tool, predict while it runs, repeat."""

from __future__ import annotations

import asyncio

from loom.data.traces import load_traces
from loom.envs.replay import ReplayEnv
from loom.predict import context as predict_context
from loom.protocol import Step, Trajectory, TrajWork
from services.envmgr.context import CONTEXT_FULL, LoopContext, call_model, context_room, trajectory
from services.envmgr.prediction import await_prediction, predict


async def run_replay(work: TrajWork, ctx: LoopContext) -> Trajectory:
    path = work.task.data.get("traces_path")
    trace_id = work.task.data["trace_id"]
    trace = load_traces(path)[trace_id]
    siblings = str(work.task.data.get("siblings", "varied"))
    env = ReplayEnv(trace, work.tool_latency, work.seed, work.max_turns, work.max_tokens, siblings)
    calls = env.calls()
    actions, observations = [c.action for c in calls], [c.observation for c in calls]
    started = ctx.clock.now()
    steps: list[Step] = []
    generated = 0
    priority = 0.0
    finish = None
    for k, call in enumerate(calls):
        # A traced context past the engines' limit is cut there, as a live one would be.
        room = await context_room(ctx, work, call.input_len)
        if room is not None and room < 1:
            finish = CONTEXT_FULL
            break
        want = call.max_new_tokens if room is None else min(call.max_new_tokens, room)
        mc = await call_model(ctx, work, k, call.input_len, want, priority)
        generated += mc.res.output_len
        tool_s = 0.0
        if not call.last:
            tool_s = env.sample_tool_latency()
            # The prediction runs during the tool call so that its latency hides behind it; it reads the
            # context so far, this call's action included, its observation not yet.
            context = call.input_len + mc.res.output_len
            pieces = predict_context.step_pieces(actions, observations, k + 1)
            pred = asyncio.create_task(
                predict(ctx, work, k + 1, context, generated, trace.task, pieces, calls[0].input_len)
            )
            await ctx.clock.sleep(tool_s)
            priority = await await_prediction(ctx, work, k, pred, priority, context, generated)
        steps.append(mc.step(call.action, "" if call.last else call.observation, tool_s))
    return trajectory(
        work,
        "completed",
        finish or env.finish_reason(len(calls)),
        steps,
        started,
        ctx.clock.now(),
        {"trace_id": trace_id, "traces_path": path},
    )

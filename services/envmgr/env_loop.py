"""The per-trajectory loop for live environments (code, math, search, coin, and libraries' environments such
as reasoning-gym's: loom.envs.registry): generate, parse, run the tool, predict while it runs, repeat until
the environment says done or a turn or token budget runs out.

Environment failures (a sandbox that will not start, an engine error) are retried with exponential
backoff and jitter; when retries run out the trajectory ends with the reason, and only that trajectory.
A model's unparsable action is not a failure: the model is told what was wrong and goes on.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from loom.envs import actions, registry, transcript
from loom.envs.base import Env, EnvError, Observation
from loom.predict import context as predict_context
from loom.protocol import Step, Trajectory, TrajWork
from loom.sandbox import SandboxError
from loom.sandbox.pool import SandboxPool
from loom.text.tokenizer import qwen_tokenizer
from services.envmgr.context import CONTEXT_FULL, LoopContext, call_model, context_room, trajectory
from services.envmgr.prediction import await_prediction, predict

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRIES = 3
# Beyond the command's own timeout: what an engine call around it may take before the step is failed.
STEP_SLACK_S = 30.0


def backoff_s(attempt: int, base: float = 0.2, cap: float = 5.0, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2^attempt)]."""
    return (rng or random).uniform(0.0, min(cap, base * 2**attempt))


async def with_retries(what: str, fn: Callable[[], Awaitable[T]], attempts: int = RETRIES) -> T:
    for attempt in range(attempts):
        try:
            return await fn()
        except (SandboxError, EnvError, TimeoutError) as e:
            if attempt == attempts - 1:
                raise EnvError(f"{what} failed after {attempts} attempts: {e}") from e
            log.info("%s failed (%s); retrying", what, e)
            await asyncio.sleep(backoff_s(attempt))
    raise AssertionError("unreachable")


async def run_env(work: TrajWork, ctx: LoopContext, pool: SandboxPool | None, sandboxed: bool) -> Trajectory:
    """``sandboxed``: the environment needs a sandbox (``registry.resolve(work.env).sandboxed``)."""
    key = f"{work.job_id}.{work.traj_id}"
    if sandboxed and pool is None:
        raise EnvError(f"environment {work.env!r} needs sandboxes and this manager has none")
    started = ctx.clock.now()
    try:
        t0 = time.perf_counter()

        async def reset() -> tuple[Env, str]:
            try:
                sb = await pool.acquire(key) if pool is not None and sandboxed else None
                env = registry.make(work.env, work.task, sb, work.tool_timeout_s)
                return env, await env.reset()
            except (SandboxError, EnvError, TimeoutError):
                if pool is not None:
                    await pool.release(key)  # the next attempt starts from a fresh sandbox
                raise

        env, prompt = await with_retries("environment reset", reset)
        if ctx.metrics:
            ctx.metrics.reset_s.labels(work.env).observe(time.perf_counter() - t0)
        script = env.reference_actions() if work.scripted else None
        steps, finish = await _episode(work, ctx, env, prompt, script)
        verdict = env.verdict()
        await env.close()
    finally:
        if pool is not None:
            await pool.release(key)
    return trajectory(
        work,
        "completed",
        finish,
        steps,
        started,
        ctx.clock.now(),
        {
            "set": work.task.data.get("set"),
            "verdict": verdict,
            "scripted": work.scripted,
            "sandbox": pool.backend_name if pool is not None and sandboxed else "none",
        },
    )


async def _episode(
    work: TrajWork, ctx: LoopContext, env: Env, prompt: str, script: list[str] | None
) -> tuple[list[Step], str]:
    tok = qwen_tokenizer()
    # The context grows by each call's output ids as the engine produced them and the observation's ids
    # (loom.envs.transcript), never by decoding and encoding again: a trainer sees exactly what the engine saw.
    ids = transcript.encode(prompt)
    prompt_tokens = len(ids)
    new_ids = list(ids)  # what this call adds to the context: the prompt, then each observation
    acts: list[str] = []
    observations: list[str] = []
    steps: list[Step] = []
    generated = 0
    priority = 0.0
    for k in range(work.max_turns):
        if script is not None and k >= len(script):
            return steps, "script_exhausted"
        budget = work.max_tokens - generated
        if budget <= 0:
            return steps, "max_tokens"
        scripted = tok.encode(script[k], disallowed_special=()) if script is not None else None
        whole = scripted
        want = len(scripted) if scripted is not None else min(budget, work.max_turn_tokens or budget)
        room = await context_room(ctx, work, len(ids), scored=scripted is not None)
        if room is not None:
            if room < 1:
                return steps, CONTEXT_FULL
            want = min(want, room)
            scripted = scripted[:room] if scripted is not None else None  # cut as the budget cuts it below
        # A scripted reply is forced: the engine scores it as its output (its log-probs under the model).
        mc = await call_model(ctx, work, k, len(ids), min(want, budget), priority, ids, forced_ids=scripted)
        res = mc.res
        generated += res.output_len
        if script is not None and scripted is not None:
            # Cut where the engine stopped (the token budget), as a real model's output would be.
            out_ids = scripted[: res.output_len]
            text = script[k] if out_ids == whole else tok.decode(out_ids)
        elif res.output_ids is not None:
            out_ids = res.output_ids
            text = transcript.action_text(out_ids)
        else:
            raise EnvError(
                "the engine returned no text; a simulated engine needs a scripted job (scripted: true)"
            )
        acts.append(text)
        t1 = ctx.clock.now()
        context = len(ids) + res.output_len
        pieces = predict_context.step_pieces(acts, [*observations, ""], k + 1)
        pred = asyncio.create_task(
            predict(ctx, work, k + 1, context, generated, prompt, pieces, prompt_tokens)
        )
        obs = await _tool(work, ctx, env, text)
        tool_s = ctx.clock.now() - t1
        priority = await await_prediction(ctx, work, k, pred, priority, context, generated)
        observations.append(obs.text)
        steps.append(mc.step(text, obs.text, tool_s, new_ids, list(out_ids)))
        if obs.done:
            return steps, "done"
        new_ids = transcript.observation_ids(obs.text)
        ids += out_ids
        ids += new_ids
    return steps, "max_turns"


async def _tool(work: TrajWork, ctx: LoopContext, env: Env, text: str) -> Observation:
    try:
        call = actions.parse(text)
    except actions.ParseError as e:
        if ctx.metrics:
            ctx.metrics.failures.labels(work.env, "parse").inc()
        return Observation(actions.invalid(e))
    t0 = time.perf_counter()

    async def step() -> Observation:
        async with asyncio.timeout(work.tool_timeout_s + STEP_SLACK_S):
            return await env.step(call)

    try:
        obs = await with_retries(f"tool {call.name}", step)
    finally:
        if ctx.metrics:
            ctx.metrics.step_s.labels(work.env, call.name).observe(time.perf_counter() - t0)
    return obs

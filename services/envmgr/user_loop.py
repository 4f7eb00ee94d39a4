"""The per-trajectory loop for environments users bring by import path (``loom.envs.api``).

The prompt is Qwen3's chat template over the environment's first messages and tools, in token ids; each
turn appends the engine's output ids as produced and the ids of what follows them (the observation as tool
results, the next generation prompt), so a trainer sees exactly what the engine saw. Prediction runs while
the environment steps, as for the built-ins.

Only this process imports the environment's code, and only from modules the operator allowed
(``loom.identity.allowlist``). A reset that fails transiently (``EnvError``, a sandbox error, a timeout) is retried on
a fresh instance; a step only on ``EnvError``, which the environment raises where a retry is safe. Anything
else fails this trajectory alone, with the reason.

A scripted job's replies are the environment's ``reference_action()`` at each turn, forced through the engine
(``forced_ids``): the trajectory records them with the engine's log-probs of them, as a sampled one would be.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import time
from typing import Any

import msgspec

from loom.envs.api import Action, StepResult
from loom.envs.base import EnvError
from loom.identity import allowlist
from loom.predict import context as predict_context
from loom.protocol import Step, Trajectory, TrajWork
from loom.sandbox import SandboxError
from loom.sandbox.pool import SandboxPool
from loom.text import chat
from loom.text.tokenizer import IM_END
from services.envmgr.context import CONTEXT_FULL, LoopContext, call_model, context_room, trajectory
from services.envmgr.env_loop import with_retries
from services.envmgr.prediction import await_prediction, predict

log = logging.getLogger(__name__)
CLOSE_S = 10.0


class EnvTimeout(Exception):
    """The environment did not answer within the job's ``tool_timeout_s`` (not retried: it may hang again)."""


class EnvBroken(Exception):
    """The environment's code raised, or answered what the interface does not allow."""


@functools.cache
def env_class(path: str) -> Any:
    """The class at ``path`` (imported once per process; the import runs the module's top level)."""
    try:
        return allowlist.load(path, "environment")
    except allowlist.NotLoaded as e:
        raise EnvBroken(str(e)) from e


def first_messages(value: Any) -> list[chat.Message]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value
    raise EnvBroken(f"reset must return a non-empty list of messages or a string, not {type(value).__name__}")


def observation_messages(result: Any, action: Action) -> list[chat.Message]:
    """A step's observation as the messages that follow the reply: tool results when the reply made calls."""
    if not isinstance(result, StepResult):
        raise EnvBroken(f"step must return a StepResult, not {type(result).__name__}")
    obs = result.observation
    if isinstance(obs, list):
        return obs
    if action.tool_calls:
        return [{"role": "tool", "content": obs}]
    return [{"role": "user", "content": obs}]


async def _guarded(what: str, timeout_s: float, coro: Any) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            return await coro
    except TimeoutError:
        raise EnvTimeout(f"{what} did not return within {timeout_s:g} s") from None


def needs_sandbox(cls: Any) -> bool:
    return bool(getattr(cls, "needs_sandbox", False))


async def run_user_env(work: TrajWork, ctx: LoopContext, cls: Any, pool: SandboxPool | None) -> Trajectory:
    """``cls`` is ``env_class(work.env)``; ``pool`` the sandboxes, where it needs them."""
    key = f"{work.job_id}.{work.traj_id}"
    sandboxed = needs_sandbox(cls)
    if sandboxed and pool is None:
        raise EnvError(f"environment {work.env!r} needs sandboxes and this manager has none")
    started = ctx.clock.now()
    env: Any = None
    try:
        t0 = time.perf_counter()

        async def reset() -> list[chat.Message]:
            nonlocal env
            try:
                kwargs = dict(work.env_params)
                if sandboxed:
                    assert pool is not None
                    kwargs["sandbox"] = await pool.acquire(key)
                # In a thread: a constructor that blocks must not stall the other trajectories' loop.
                env = await asyncio.to_thread(cls, **kwargs)
                try:
                    messages = await asyncio.wait_for(env.reset(dict(work.task.data)), work.tool_timeout_s)
                except (EnvError, SandboxError, TimeoutError):
                    raise
                except Exception as e:
                    raise EnvBroken(f"reset raised {type(e).__name__}: {e}") from e
                return first_messages(messages)
            except (EnvError, SandboxError, TimeoutError):
                # The next attempt starts from a fresh instance and a fresh sandbox.
                if env is not None:
                    await _close(env)
                    env = None
                if pool is not None:
                    await pool.release(key)
                raise
            except EnvBroken:
                raise
            except Exception as e:
                raise EnvBroken(f"{work.env} could not be made: {type(e).__name__}: {e}") from e

        messages = await with_retries("environment reset", reset)
        if ctx.metrics:
            ctx.metrics.reset_s.labels(work.env).observe(time.perf_counter() - t0)
        tools = list(getattr(env, "tools", None) or [])
        steps, finish, rewards, info = await _episode(work, ctx, env, messages, tools)
    finally:
        if env is not None:
            await _close(env)
        if pool is not None:
            await pool.release(key)
    verdict: dict[str, Any] = {"rewards": rewards, "info": info}
    given = [r for r in rewards if r is not None]
    if given:
        verdict["score"] = float(sum(given))
    return trajectory(
        work,
        "completed",
        finish,
        steps,
        started,
        ctx.clock.now(),
        {"verdict": verdict, "sandbox": pool.backend_name if pool is not None and sandboxed else "none"},
    )


async def _episode(
    work: TrajWork, ctx: LoopContext, env: Any, messages: list[chat.Message], tools: list[dict[str, Any]]
) -> tuple[list[Step], str, list[float | None], dict[str, Any]]:
    try:
        prompt_text = chat.render(messages, tools)
    except chat.ChatError as e:
        raise EnvBroken(f"reset's messages: {e}") from e
    ids = chat.encode(prompt_text)
    prompt_tokens = len(ids)
    new_ids = list(ids)
    steps: list[Step] = []
    rewards: list[float | None] = []
    info: dict[str, Any] = {}
    acts: list[str] = []
    observations: list[str] = []
    generated = 0
    priority = 0.0
    for k in range(work.max_turns):
        budget = work.max_tokens - generated
        if budget <= 0:
            return steps, "max_tokens", rewards, info
        want = min(budget, work.max_turn_tokens or budget)
        room = await context_room(ctx, work, len(ids), scored=work.scripted)
        if room is not None:
            if room < 1:
                return steps, CONTEXT_FULL, rewards, info
            want = min(want, room)
        forced = await _scripted_reply(work, env, k) if work.scripted else None
        if forced is not None:
            # The engine generates (the simulator: charges) the reply's tokens only, as many as fit.
            forced = forced[:want]
            want = len(forced)
        mc = await call_model(ctx, work, k, len(ids), want, priority, ids, forced_ids=forced)
        out_ids = mc.res.output_ids
        if out_ids is None:
            raise EnvError("the engine returned no token ids")
        generated += mc.res.output_len
        text = chat.reply_text(out_ids)
        reply = chat.parse_reply(text)
        action = Action(text, reply.content, reply.tool_calls)
        acts.append(text)
        t1 = ctx.clock.now()
        context = len(ids) + len(out_ids)
        pieces = predict_context.step_pieces(acts, [*observations, ""], k + 1)
        pred = asyncio.create_task(
            predict(ctx, work, k + 1, context, generated, prompt_text, pieces, prompt_tokens)
        )
        result = await _step(work, env, k, action)
        tool_s = ctx.clock.now() - t1
        priority = await await_prediction(ctx, work, k, pred, priority, context, generated)
        follow = observation_messages(result, action)
        obs_text = chat.joined_text(follow)
        observations.append(obs_text)
        rewards.append(_reward(result.reward, k))
        info = _info(result.info, k)
        steps.append(mc.step(text, obs_text, tool_s, new_ids, list(out_ids)))
        if result.done:
            return steps, "done", rewards, info
        try:
            new_ids = chat.encode(chat.continuation(follow, chat.ended(out_ids)))
        except chat.ChatError as e:
            raise EnvBroken(f"step {k}'s observation: {e}") from e
        ids += out_ids
        ids += new_ids
    return steps, "max_turns", rewards, info


async def _scripted_reply(work: TrajWork, env: Any, k: int) -> list[int]:
    """A scripted turn's reply: the environment's ``reference_action()`` now (it may depend on what the
    environment said so far), as the ids of a reply that ends its turn, for the engine to score as its own."""
    ref = getattr(env, "reference_action", None)
    if ref is None:
        raise EnvBroken(f"{work.env} has no reference_action() to script replies with")
    call = ref() if inspect.iscoroutinefunction(ref) else asyncio.to_thread(ref)
    value = await _guarded(f"reference_action at step {k}", work.tool_timeout_s, call)
    if not isinstance(value, str) or not value:
        raise EnvBroken(f"reference_action must return a non-empty string, not {value!r}")
    return [*chat.encode(value), IM_END]


def _reward(value: Any, k: int) -> float | None:
    """A step's reward as a float (numpy scalars and ints too); EnvBroken when it is not a finite number."""
    if value is None:
        return None
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise EnvBroken(f"step {k}'s reward is not a number: {value!r}") from None
    if not math.isfinite(r):
        raise EnvBroken(f"step {k}'s reward is not finite: {r}")
    return r


def _info(value: Any, k: int) -> dict[str, Any]:
    """A step's info as plain data that travels with the trajectory; EnvBroken when it cannot."""
    try:
        out = msgspec.to_builtins(value)
    except (TypeError, ValueError) as e:
        raise EnvBroken(f"step {k}'s info cannot be stored: {e}") from e
    if not isinstance(out, dict):
        raise EnvBroken(f"step {k}'s info must be a dict, not {type(value).__name__}")
    return out


async def _step(work: TrajWork, env: Any, k: int, action: Action) -> StepResult:
    async def once() -> StepResult:
        try:
            result = await _guarded(f"step {k}", work.tool_timeout_s, env.step(action))
        except (EnvError, EnvTimeout):
            raise
        except Exception as e:
            raise EnvBroken(f"step {k} raised {type(e).__name__}: {e}") from e
        if not isinstance(result, StepResult):
            raise EnvBroken(f"step {k} returned {type(result).__name__}, not a StepResult")
        return result

    return await with_retries(f"environment step {k}", once)


async def _close(env: Any) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        await asyncio.wait_for(close(), CLOSE_S)
    except Exception as e:  # a failing close loses nothing of the trajectory
        log.warning("closing an environment failed: %s", e)

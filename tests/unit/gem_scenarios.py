"""Scenarios that run inside GEM's virtualenv (``.venv-gem/bin/python -m tests.unit.gem_scenarios NAME``), where
the real gem-llm 0.1.0 is installed, each printing one JSON line for tests/unit/test_gem_adapter.py to check."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from loom.envs import registry
from loom.envs.api import Action, StepResult

GUESS = "gem:game:GuessTheNumber-v0-easy"
MATH = "gem:math:GSM8K"


def _act(text: str) -> Action:
    return Action(text, text, [])


def _data(env: str, ids: list[str], params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return [dict(t.data) for t in registry.task_specs(env, None, None, ids, params or {})]


def _cls(env: str) -> Any:
    return registry.user_class(env, lambda path: None)


def _result(r: StepResult) -> dict[str, Any]:
    return {"observation": r.observation, "done": r.done, "reward": r.reward, "info": r.info}


async def _scripted(env: Any, data: dict[str, Any], turns: int) -> tuple[Any, list[dict[str, Any]]]:
    """Reset ``env`` on ``data`` and play its reference actions for at most ``turns`` steps."""
    first = await env.reset(data)
    steps = []
    for _ in range(turns):
        reply = env.reference_action()
        r = await env.step(_act(reply))
        steps.append({"reply": reply, **_result(r)})
        if r.done:
            break
    return first, steps


async def games() -> dict[str, Any]:
    cls = _cls(GUESS)
    out: dict[str, Any] = {"class": cls.__name__, "needs_sandbox": bool(getattr(cls, "needs_sandbox", False))}
    played = []
    for data in _data(GUESS, [str(i) for i in range(10)]):
        env = cls()
        first, steps = await _scripted(env, data, 10)
        secret = env.env.unwrapped.game_number
        await env.close()
        played.append({"seed": data["task_id"], "first": first, "secret": secret, "steps": steps})
    out["played"] = played

    # Concurrent resets of one seed: GEM seeds the process-wide RNG, so each must still get that seed's game.
    async def secret_of(seed: str) -> int:
        env = cls()
        await env.reset(_data(GUESS, [seed])[0])
        n = int(env.env.unwrapped.game_number)
        await env.close()
        return n

    out["concurrent"] = await asyncio.gather(*(secret_of(s) for s in ["0", "1"] * 8))
    env = cls()
    await env.reset(_data(GUESS, ["0"])[0])
    out["unformatted"] = _result(await env.step(_act("I think it is five.")))
    return out


async def gsm8k() -> dict[str, Any]:
    from loom.sandbox import Limits
    from loom.sandbox.pool import SandboxPool
    from loom.sandbox.process_backend import ProcessBackend

    cls = _cls(MATH)
    out: dict[str, Any] = {"needs_sandbox": bool(getattr(cls, "needs_sandbox", False))}
    # Not under pytest's tmp_path: its 0700 parents would keep the unprivileged sandbox user out.
    base = Path(tempfile.gettempdir()) / f"loom-gem-test-{uuid.uuid4().hex[:8]}"
    pool = SandboxPool(ProcessBackend(base), Limits(memory_mb=512, pids=64), warm=0, max_sandboxes=4)
    await pool.start()
    try:
        scripted = []
        for data in _data(MATH, [f"gsm8k-test/{i}" for i in range(4)]):
            async with pool.session(data["task_id"]) as sb:
                env = cls(sandbox=sb)
                first, steps = await _scripted(env, data, 4)
                await env.close()
            scripted.append({"task_id": data["task_id"], "first": first, "steps": steps})
        out["scripted"] = scripted
        data = _data(MATH, ["gsm8k-test/0"])[0]
        async with pool.session("free") as sb:
            env = cls(sandbox=sb)
            await env.reset(data)
            out["error"] = _result(await env.step(_act("<python>print(1/0)</python>")))
            out["hang"] = _result(await env.step(_act("```python\nwhile True:\n    pass\n```")))
            out["wrong"] = _result(await env.step(_act("So \\boxed{17}.")))
            await env.close()
        plain = _data(MATH, ["gsm8k-test/1"], {"tool": None})[0]
        env = cls(sandbox=None)
        out["plain_first"] = await env.reset(plain)
        out["plain_script"] = env.reference_action()
        out["plain"] = _result(await env.step(_act(env.reference_action())))
        await env.close()
    finally:
        await pool.close()
        base.rmdir()
    return out


def wire(given: list[str] | None = None) -> dict[str, list[str]]:
    """Loom's messages the GEM manager sends and receives, encoded here (msgpack, hex), and ``given`` (another
    interpreter's encodings of the same messages) decoded here and encoded again."""
    from loom.protocol import (
        GenRequest,
        GenResult,
        Job,
        JobSpec,
        RewardRequest,
        Step,
        TaskSpec,
        Trajectory,
        TrajMeta,
        decode,
        encode,
    )
    from services.scheduler.tasks import expand

    # The wire format is what is checked here, not the env: any name JobSpec takes will do.
    env = "reasoning_gym:chain_sum"
    spec = JobSpec(
        env=env, tasks=[TaskSpec(id="3", data={"set": GUESS, "params": {"size": 4}})], group_size=2
    )
    works = expand("job-1", spec)
    step = Step(
        index=0,
        prompt_len=3,
        output_len=2,
        action="\\boxed{5}",
        observation="higher",
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=[-0.5, -1.25],
    )
    traj = Trajectory("job-1", "t0", "3", 0, 0, env, "completed", "done", [step], 1.0, 2.5, 1.0, {"v": [1]})
    items: list[Any] = [
        *works,
        spec,
        Job(id="job-1", spec=spec, state="running", created_at=1.0, n_trajectories=2),
        GenRequest(
            rid="r", job_id="job-1", traj_id="t0", step=0, input_len=3, max_new_tokens=8, input_ids=[1]
        ),
        GenResult(rid="r", worker_id="w0", output_len=2, finish_reason="stop", output_ids=[4, 5]),
        RewardRequest(traj, "env", "default", works[0].task, {}),
        TrajMeta(job_id="job-1", traj_id="t0", priority=0.5),
    ]
    again = [
        encode(decode(bytes.fromhex(h), type(x))).hex() for h, x in zip(given or [], items, strict=False)
    ]
    return {"encoded": [encode(x).hex() for x in items], "again": again}


if __name__ == "__main__":
    name = sys.argv[1]
    if name == "wire":
        result: Any = wire(json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
    else:
        result = asyncio.run({"games": games, "gsm8k": gsm8k}[name]())
    sys.stdout.write(json.dumps(result) + "\n")

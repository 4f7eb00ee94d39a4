"""``loom bench engine --real``: a small Qwen3 on the transformers engine on this CPU, generating GRPO groups of
multi-turn math trajectories (``loom train``'s task and policy), with and without drafting (``--speculative``).

The policy is ``loom train``'s: the tiny Qwen3 warm-started on the arithmetic tasks' reference transcripts
(``loom.trainer.warmstart``), cached under ``$LOOM_CACHE`` (a few minutes the first time), or a local
checkpoint (``--model-path``). Each held-out task is a group of ``GROUP`` trajectories submitted together, as
the rollout service submits a group: each generates a calculator call, gets the calculator's observation and
generates again, up to ``loom train``'s turns and token budgets. Both engines serve the same trajectories
with the same seeds, one after the other in this process; drafting is lossless, so both sample from the same
distribution (under greedy decoding, the same tokens). Reported per temperature: output tokens per wall
second end to end (prefills, tool calls and the engine's own loop included), and for the drafting engine its
verification steps: accepted tokens per step, the share of steps that drafted, and drafted tokens kept.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom import checkpoints as policy
from loom.engine.base import EngineRequest
from loom.engine.clients.hf import HFEngine
from loom.envs import actions
from loom.envs.base import Observation
from loom.envs.math_env import MathEnv
from loom.envs.tasksets import MathTask, arith
from loom.envs.transcript import encode, observation_ids
from loom.settings import cache_dir
from loom.speculative.drafter import Tally
from loom.text.tokenizer import STOP_IDS, qwen_tokenizer
from loom.trainer.warmstart import TINY_POLICY, InProcessCalculator, WarmStartConfig, warm_start

GROUP = 8
# loom train's arith task: three turns, 48 tokens a turn, 96 in all.
MAX_TURNS, TURN_TOKENS, MAX_TOKENS = 3, 48, 96
TASKS = {"quick": 2, "full": 16}
TEMPERATURES = (1.0, 0.0)  # loom train samples at 1.0; greedy is drafting's best case
# "batch": every group at once, as a rollout starts; "tail": one trajectory at a time, beside the outputs of
# those before it, as a rollout's last trajectories run once the rest are done.
SHAPES = ("batch", "tail")


def cached_policy(seed: int = 0) -> Path:
    """``loom train``'s initial checkpoint for ``seed`` (the tiny policy after its warm start), built once and
    kept under ``$LOOM_CACHE``."""
    cfg = WarmStartConfig(seed=seed)
    key = f"tiny-arith-s{seed}-w{cfg.steps}-c{cfg.copy_steps}-t{cfg.target_loss}"
    root = cache_dir("policies") / key
    if (root / "config.json").is_file():
        return root
    model = policy.build_tiny(seed=seed, **TINY_POLICY)
    warm_start(model, list(arith("train").values()), steps=cfg.steps, seed=seed)
    partial = root.with_name(root.name + ".partial")
    policy.save(model, partial)
    partial.rename(root)
    return root


@dataclass
class _Run:
    output_tokens: int = 0
    trajectories: int = 0
    turns: int = 0
    solved: int = 0


async def _trajectory(engine: HFEngine, task: MathTask, rid: str, temperature: float, run: _Run) -> None:
    env = MathEnv(task, InProcessCalculator())
    ids = encode(await env.reset())
    spent = 0
    for turn in range(MAX_TURNS):
        budget = min(TURN_TOKENS, MAX_TOKENS - spent)
        if budget <= 0:
            break
        out = await engine.generate(
            EngineRequest(
                f"{rid}-{turn}",
                len(ids),
                budget,
                input_ids=ids,
                temperature=temperature,
                stop_token_ids=list(STOP_IDS),
            )
        )
        got = out.output_ids or []
        spent += len(got)
        run.output_tokens += len(got)
        run.turns += 1
        text = qwen_tokenizer().decode([i for i in got if i not in STOP_IDS])
        try:
            obs = await env.step(actions.parse(text))
        except actions.ParseError as e:
            obs = Observation(actions.invalid(e))
        if obs.done:
            run.solved += int(env.verdict().get("correct", False))
            break
        ids = [*ids, *got, *observation_ids(obs.text)]
    run.trajectories += 1


async def _serve(
    path: Path,
    trajectories: list[tuple[MathTask, str]],
    temperature: float,
    speculative: bool,
    seed: int,
    shape: str,
) -> dict[str, Any]:
    threads = max(1, torch.get_num_threads())
    engine = HFEngine(
        str(path), max_running=len(trajectories), threads=threads, seed=seed, speculative=speculative
    )
    await engine.start()
    try:
        # One request first, so that neither side's clock holds the model's first-call costs.
        await engine.generate(EngineRequest("warm", 4, 4, input_ids=encode("What is 1+1?")))
        before = _counts(engine.drafts.stats) if engine.drafts is not None else (0, 0, 0, 0)
        run = _Run()
        t0 = time.perf_counter()
        if shape == "batch":
            await asyncio.gather(*(_trajectory(engine, t, rid, temperature, run) for t, rid in trajectories))
        else:
            for t, rid in trajectories:
                await _trajectory(engine, t, rid, temperature, run)
        wall = time.perf_counter() - t0
    finally:
        await engine.close()
    out: dict[str, Any] = {
        "wall_s": round(wall, 3),
        "output_tokens": run.output_tokens,
        "tokens_per_s": round(run.output_tokens / wall, 1),
        "trajectories": run.trajectories,
        "turns": run.turns,
        "solved": run.solved,
    }
    if engine.drafts is not None:
        steps, drafting, drafted, accepted = (
            a - b for a, b in zip(_counts(engine.drafts.stats), before, strict=True)
        )
        # Rows of verification steps (a step with no draft in any row is a plain decode step, not counted).
        out.update(verified_rows=steps, drafting_rows=drafting, drafted=drafted, accepted=accepted)
    return out


def _drafting_figures(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Over every run: accepted tokens per verified row, the share of verified rows that drafted, and the
    share of drafted tokens kept."""
    rows, drafting, drafted, accepted = (
        sum(r[k] for r in runs) for k in ("verified_rows", "drafting_rows", "drafted", "accepted")
    )
    return {
        "accepted_per_step": round(accepted / rows, 3) if rows else 0.0,
        "drafting_share": round(drafting / rows, 3) if rows else 0.0,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
    }


def _counts(t: Tally) -> tuple[int, int, int, int]:
    return t.steps, t.drafting_steps, t.drafted, t.accepted


def real(
    quick: bool, speculative: bool, model_path: str | None, seed: int = 0, repeats: int | None = None
) -> dict[str, Any]:
    """Each temperature: the plain engine and (``speculative``) the drafting one, ``repeats`` times alternating,
    the median wall time of each reported with every run."""
    t0 = time.perf_counter()
    path = Path(model_path) if model_path else cached_policy(seed)
    prepared_s = time.perf_counter() - t0
    tasks = list(arith("eval").values())[: TASKS["quick" if quick else "full"]]
    repeats = repeats or (1 if quick else 3)
    modes = (False, True) if speculative else (False,)
    # An unmeasured run first: the first in a process pays for warming torch's threads and allocator.
    asyncio.run(_serve(path, [(tasks[0], "warm-up")], 1.0, False, seed, "batch"))
    result: dict[str, Any] = {
        "model_path": str(path),
        "policy": "--model-path" if model_path else "loom train's tiny Qwen3, warm-started on arith (cached)",
        "policy_ready_s": round(prepared_s, 1),
        "threads": torch.get_num_threads(),
        "tasks": len(tasks),
        "group": GROUP,
        "max_turns": MAX_TURNS,
        "turn_tokens": TURN_TOKENS,
        "by_shape": {},
    }
    groups = [[(task, f"{task.id}/{g}") for g in range(GROUP)] for task in tasks]
    # The tail: one group's trajectories one after another (half of it in a quick run).
    chosen = {
        "batch": [t for group in groups for t in group],
        "tail": groups[0][: GROUP // 2 if quick else GROUP],
    }
    for shape in SHAPES:
        for temperature in TEMPERATURES:
            runs: dict[bool, list[dict[str, Any]]] = {m: [] for m in modes}
            for _ in range(repeats):
                for m in modes:
                    runs[m].append(asyncio.run(_serve(path, chosen[shape], temperature, m, seed, shape)))
            cell: dict[str, Any] = {"trajectories": len(chosen[shape])}
            for m, rs in runs.items():
                rate = statistics.median(r["tokens_per_s"] for r in rs)
                cell["drafting" if m else "plain"] = {"tokens_per_s": rate, "runs": rs}
                if m:
                    cell["drafting"].update(_drafting_figures(rs))
            if speculative:
                cell["speedup"] = round(cell["drafting"]["tokens_per_s"] / cell["plain"]["tokens_per_s"], 3)
            result["by_shape"].setdefault(shape, {})[str(temperature)] = cell
    return result

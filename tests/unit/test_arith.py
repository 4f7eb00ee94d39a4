"""Generated arithmetic for the math environment, the in-process calculator and the warm start's sequences."""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from loom.checkpoints import TINY, build_tiny
from loom.envs import actions, registry, tasksets
from loom.envs.base import show
from loom.envs.math_env import MathEnv
from loom.sandbox.types import ExecResult
from loom.text.tokenizer import STOP_IDS
from loom.trainer import grpo
from loom.trainer.warmstart import (
    InProcessCalculator,
    WarmStartConfig,
    copy_sequence,
    digit_ids,
    prompts,
    reference_sequence,
    run_python,
    sampled_nll,
    warm_start,
)
from tests.conftest import need_shared


def test_arith_sets_are_deterministic_sized_and_disjoint() -> None:
    train, held = tasksets.arith("train"), tasksets.arith("eval")
    assert len(train) == tasksets.ARITH_SIZES["train"] and len(held) == tasksets.ARITH_SIZES["eval"]
    # Generated afresh (not from the cache), the sets are the same.
    assert tasksets.arith.__wrapped__("train") == train and tasksets.arith.__wrapped__("eval") == held
    q_train = [t.question for t in train.values()]
    q_held = [t.question for t in held.values()]
    assert len(set(q_train)) == len(q_train) and len(set(q_held)) == len(q_held)
    assert not set(q_train) & set(q_held)
    assert list(train)[:2] == ["arith/0", "arith/1"] and next(iter(held)) == "arith-eval/0"
    with pytest.raises(KeyError):
        tasksets.arith("test")


def test_arith_tasks_need_the_calculator() -> None:
    lo, hi = tasksets.ARITH_RANGE
    for t in [*tasksets.arith("train").values(), *tasksets.arith("eval").values()]:
        a, b, c = (
            int(x) for x in t.question.removeprefix("What is ").rstrip("?").replace("*", "+").split("+")
        )
        assert all(lo <= x <= hi for x in (a, b, c))
        assert t.answer == str(a * b + c) and len(t.answer) >= 5
        assert tasksets.final_answer(t.solution) == t.answer


def test_registry_serves_arith_like_the_gsm8k_sets() -> None:
    assert {"arith", "arith-eval"} <= set(registry.DATASETS["math"])
    ids = registry.task_ids("math", "arith", None)
    assert len(ids) == tasksets.ARITH_SIZES["train"] and ids[0] == "arith/0"
    held = registry.task_ids("math", "arith-eval", None)
    assert not set(ids) & set(held)
    specs = registry.task_specs("math", "arith-eval", None, held[:3])
    assert [s.id for s in specs] == held[:3]
    assert specs[0].data["set"] == "arith-eval" and specs[0].data["prompt"].startswith("What is ")
    assert registry.task_of(specs[0]) == tasksets.arith("eval")[held[0]]
    script = registry.reference_actions("math", specs[0])
    assert actions.parse(script[0]).name == "python" and actions.parse(script[-1]).name == "Finish"
    with pytest.raises(ValueError, match="generated"):
        registry.task_ids("math", "arith", "/some/file.jsonl")
    with pytest.raises(ValueError):
        registry.task_ids("code", "arith", None)


def test_reference_actions_solve_the_tasks_through_math_env() -> None:
    async def solve(t: tasksets.MathTask) -> tuple[str, bool]:
        env = MathEnv(t, InProcessCalculator())
        await env.reset()
        script = env.reference_actions()
        assert len(script) == 2
        obs = await env.step(actions.parse(script[0]))
        assert not obs.done
        end = await env.step(actions.parse(script[1]))
        assert end.done
        return obs.text, bool(env.verdict()["correct"])

    tasks = [*tasksets.arith("eval").values(), *list(tasksets.arith("train").values())[:500]]
    for t in tasks:
        shown, correct = asyncio.run(solve(t))
        assert shown == t.answer and correct, t


# ---------------------------------------------------------------- the in-process calculator


def test_run_python_prints_what_python_prints() -> None:
    rng = random.Random(3)
    for _ in range(200):
        a, b, c = rng.randint(-999, 9999), rng.randint(1, 9999), rng.randint(0, 99)
        expr = rng.choice(
            [f"{a}*{b}+{c}", f"{a}/{b}", f"({a}-{c})//{b}", f"{a}%{b}", f"-{c}**2", f"{a} * 1.5"]
        )
        r = run_python(f"print({expr})")
        assert r.exit_code == 0 and r.stdout == f"{eval(expr)}\n", expr
    assert run_python("print(1)\nprint(2*3)").stdout == "1\n6\n"
    for bad in ("print(1/0)", "import os", "print(x)", "print(", "print(2**999999)", "open('f')"):
        r = run_python(bad)
        assert r.exit_code == 1 and r.stderr and not r.stdout, bad


def test_the_calculator_shows_what_the_sandbox_would(tmp_path: Path) -> None:
    """``show`` of the in-process result equals ``show`` of running the file with Python."""
    for code in ("print(5712*4804+4796)", "print(7/2)", "print(3)\nprint(4)"):
        (tmp_path / "calc.py").write_text(code)
        p = subprocess.run(
            [sys.executable, "calc.py"], cwd=tmp_path, capture_output=True, text=True, check=False
        )
        real = show(ExecResult(p.returncode, p.stdout, p.stderr, 0.0))
        assert show(run_python(code)) == real


# ---------------------------------------------------------------- the warm start


def test_reference_sequence_is_the_live_transcript() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    from loom.envs.transcript import encode, observation_ids

    t = tasksets.arith("train")["arith/0"]
    (prompt,) = prompts([t])
    assert prompt == asyncio.run(MathEnv(t, InProcessCalculator()).reset())
    call, finish = MathEnv(t, InProcessCalculator()).reference_actions()
    f = reference_sequence(t, prompt)
    p, c, o, a = (
        encode(prompt),
        [*encode(call), STOP_IDS[0]],
        observation_ids(t.answer),
        [*encode(finish), STOP_IDS[0]],
    )
    assert f.ids.tolist() == p + c + o + a
    assert f.loss_mask.tolist() == [0] * len(p) + [1] * len(c) + [0] * len(o) + [1] * len(a)
    assert not f.behaviour_logprobs.any()


def _small_vocab_model(vocab: int) -> torch.nn.Module:
    cfg = {**TINY, "vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    cfg.update(num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    config = Qwen3Config(**cfg, bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_sampled_softmax_estimates_the_exact_nll() -> None:
    model = _small_vocab_model(300)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)  # spread the logits: the estimate has work to do
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 40, (3, 12), generator=g)
    mask = torch.zeros(3, 12)
    mask[:, 6:] = 1
    batch = grpo.collate(
        [grpo.Flat(i, m, torch.zeros(12)) for i, m in zip(ids, mask, strict=True)], [0.0] * 3
    )
    with torch.no_grad():
        exact = float(-grpo.sequence_logprobs(model, batch, 1.0).mean())
        estimates = [float(sampled_nll(model, batch, 2000, g)) for _ in range(5)]
    assert all(math.isclose(e, exact, rel_tol=0.05) for e in estimates), (exact, estimates)


def test_copy_sequence_drops_the_system_text_and_scores_only_digits() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    from loom.envs.math_env import SYSTEM
    from loom.envs.transcript import encode

    t = tasksets.arith("train")["arith/0"]
    (prompt,) = prompts([t])
    full, short = reference_sequence(t, prompt), copy_sequence(t, prompt)
    assert len(full.ids) - len(short.ids) == len(encode(prompt)) - len(encode(prompt.replace(SYSTEM, "")))
    scored = [i for i, m in zip(short.ids.tolist(), short.loss_mask.tolist(), strict=True) if m]
    # The operands in the call, the answer in the thought and in Finish: 9 + 6 + 6 digits.
    assert len(scored) == 21 and set(scored) <= digit_ids() and len(digit_ids()) == 10
    # After the first token ("\n" here, ".\n\n" after the system text) the sequences agree.
    assert full.ids.tolist()[-len(short.ids) + 1 :] == short.ids.tolist()[1:]


def test_warm_start_runs_both_phases_and_lowers_the_loss() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    model = build_tiny(0, hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8)
    tasks = list(tasksets.arith("train").values())[:8]
    seen: list[dict[str, float]] = []
    cfg = WarmStartConfig(warmup_steps=2, copy_steps=8, target_loss=None)
    m = warm_start(model, tasks, steps=16, batch=4, lr=5e-2, seed=1, cfg=cfg, log=seen.append)
    assert [d["phase"] for d in seen] == [1.0] * 8 + [2.0] * 8
    assert m["steps"] == 16 and m["copy_steps"] == 8 and not model.training and not m["reached_target"]
    first, second = [d["loss"] for d in seen[:8]], [d["loss"] for d in seen[8:]]
    assert first[-1] < first[0] - 1.0 and second[-1] < second[0]
    # The second phase stops at the first step whose loss reaches the target.
    target = sorted(second)[3]
    again = build_tiny(0, hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8)
    cfg = WarmStartConfig(warmup_steps=2, copy_steps=8, target_loss=target)
    m = warm_start(again, tasks, steps=16, batch=4, lr=5e-2, seed=1, cfg=cfg)
    stop = 8 + next(i for i, x in enumerate(second) if x <= target) + 1
    assert (
        m["steps"] == stop
        and m["reached_target"]
        and math.isclose(m["loss"], seen[stop - 1]["loss"], rel_tol=1e-4)
    )

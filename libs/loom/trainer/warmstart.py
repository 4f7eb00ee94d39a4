"""A short supervised warm start of a fresh policy on the math environment's reference solutions.

A randomly initialised policy never emits a well-formed tool call, so RL from scratch sees reward 0 and
learns nothing. The warm start trains it on the reference scripts of training tasks, built token for token
as a live trajectory's context grows (``loom.envs.transcript``): the prompt from ``MathEnv.reset()``, the tool
call and its stop token, the observation the sandbox would show for the printed result, then the
``Finish[...]`` answer and its stop token. The loss is on the model's outputs only (the two calls), as in RL.
Stopped early, it leaves the policy partially competent, which is what GRPO then improves.

It runs in two phases. A small model trained from scratch on the plain recipe learns the fixed template
within ~100 steps but then does not learn to copy numbers at all (measured with the tiny policy on ``arith``:
digit loss still at chance, ln 10, after 700 steps): the template's sharp attention patterns leave nothing
to find the digits with, and the long fixed system text dilutes what attention there is. So the first phase
(``copy_steps``) trains on the same sequences without the system text, with the loss on digit
tokens only: copying ignites in ~100 steps. The second phase trains on exactly the transcript format, every
output token, and carries the copying over to the full context within a few dozen steps; competence then
rises steeply (from ~2% to ~80% of exact reference transcripts at temperature 1 within 20 steps), so the
second phase stops as soon as a step's loss reaches ``target_loss`` rather than after a fixed count: with ~62
output tokens per transcript, a token-mean loss of 0.03 leaves about exp(-0.03 * 62) = 16% of them exact.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import math
import operator
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from loom.envs import actions
from loom.envs.base import show
from loom.envs.math_env import SYSTEM, MathEnv
from loom.envs.tasksets import MathTask
from loom.envs.transcript import encode, observation_ids
from loom.sandbox.types import ExecResult
from loom.text.tokenizer import STOP_IDS
from loom.trainer.grpo import Batch, Flat, collate, output_embeddings, sequence_logprobs

# The tiny policy the recipe was measured with: ``loom.checkpoints.build_tiny(seed, **TINY_POLICY)`` (hidden 128,
# 4 layers, 4 heads of 32). Two changes from ``loom.checkpoints.TINY``, both for copying numbers: a key/value head
# per query head (with 2 shared ones, the observation-to-answer copy failed to form in 2 of 3 seeds), and
# RoPE base 500 instead of 10,000, which gives more rotary frequencies that resolve offsets of 10-40 tokens
# (copying ignited by step ~60-80 in 3 of 3 seeds; with 10,000 it stalled in 1 of 3 within 220 steps).
TINY_POLICY: dict[str, Any] = {
    "num_key_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
}


@dataclass(frozen=True)
class WarmStartConfig:
    """The warm start measured to leave the tiny policy partially competent on held-out ``arith`` tasks."""

    # At most this many steps in all; the first ``copy_steps`` on prompts without the system text and the
    # loss on digits only, then the transcript format until a step's loss is at most ``target_loss``.
    steps: int = 300
    copy_steps: int = 140
    target_loss: float | None = 0.03
    batch: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 10
    # The learning rate decays (cosine) to this fraction of ``lr`` by the last step (1.0: constant).
    final_lr_frac: float = 1.0
    max_grad_norm: float = 1.0
    # Sampled softmax: the loss normalises over every id that is a target in the batch plus this many ids
    # drawn uniformly from the rest of the vocabulary (their share of the partition function scaled up to
    # the whole rest, the log Q correction of Jean et al. 2015). A step costs ~1/20 of the exact softmax
    # over 151,680 rows; None uses the exact softmax. RL and evaluation always use the exact one.
    negatives: int | None = 4096
    head_chunk: int = 256
    seed: int = 0


# ---------------------------------------------------------------- the calculator, in process

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_LIMIT = 10**60


def _value(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
            raise ValueError("exponent too large for the in-process calculator")
        v = _BINARY[type(node.op)](a, b)
        if isinstance(v, complex) or abs(v) > _LIMIT:
            raise ValueError("result out of the in-process calculator's range")
        return v
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def run_python(code: str) -> ExecResult:
    """What ``python3 calc.py`` returns for ``code`` when the program prints arithmetic (``print(expr)``,
    one per line): the printed lines, exit 0. Anything else gets exit 1 and an error message (the sandbox
    would show a traceback). For scripted warm starts and offline loops; live rollouts use the sandbox."""
    try:
        tree = ast.parse(code)
        lines = []
        for stmt in tree.body:
            call = stmt.value if isinstance(stmt, ast.Expr) else None
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name)
                and call.func.id == "print"
                and not call.keywords
            ):
                raise ValueError("only print(<arithmetic>) statements run in process")
            lines.append(" ".join(str(_value(a)) for a in call.args))
    except SyntaxError as e:
        return ExecResult(1, "", f"SyntaxError: {e.msg}", 0.0)
    except ZeroDivisionError as e:
        return ExecResult(1, "", f"ZeroDivisionError: {e}", 0.0)
    except (ValueError, OverflowError, RecursionError) as e:
        return ExecResult(1, "", f"Error: {e}", 0.0)
    return ExecResult(0, "".join(f"{line}\n" for line in lines), "", 0.0)


class InProcessCalculator:
    """A stand-in sandbox for ``MathEnv`` that runs ``calc.py`` with ``run_python``."""

    def __init__(self) -> None:
        self.id = self.backend = "in-process"
        self.files: dict[str, str] = {}

    async def write_files(self, files: dict[str, bytes | str]) -> None:
        for name, body in files.items():
            self.files[name] = body.decode() if isinstance(body, bytes) else body

    async def exec(
        self, cmd: list[str], *, timeout_s: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        if cmd[:1] != ["python3"] or len(cmd) != 2:
            return ExecResult(127, "", f"{cmd[0] if cmd else ''}: not available in process", 0.0)
        return run_python(self.files.get(cmd[1], ""))

    async def close(self) -> None:
        pass


# ---------------------------------------------------------------- supervised sequences


def prompts(tasks: Sequence[MathTask]) -> list[str]:
    """``MathEnv.reset()`` of each task: the prompt a live trajectory starts from."""

    async def all_prompts() -> list[str]:
        return [await MathEnv(t, InProcessCalculator()).reset() for t in tasks]

    return asyncio.run(all_prompts())


def reference_sequence(task: MathTask, prompt: str) -> Flat:
    """The reference script of ``task`` as the context a live trajectory builds: the prompt's ids, then per
    call its output ids with the stop token, then the ids of the observation that followed (scored: the
    outputs)."""
    script = MathEnv(task, InProcessCalculator()).reference_actions()
    ids = encode(prompt)
    mask = [0.0] * len(ids)
    for k, action in enumerate(script):
        out = [*encode(action), STOP_IDS[0]]
        ids += out
        mask += [1.0] * len(out)
        if k == len(script) - 1:
            break
        call = actions.parse(action)
        obs = observation_ids(show(run_python(str(call.arguments.get("code", "")))))
        ids += obs
        mask += [0.0] * len(obs)
    return Flat(
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(mask, dtype=torch.float32),
        torch.zeros(len(ids), dtype=torch.float32),
    )


def sampled_nll(model: nn.Module, batch: Batch, negatives: int, gen: torch.Generator) -> Tensor:
    """Token-mean negative log-likelihood of the scored tokens under a sampled softmax: the exact logits of
    every target id of the batch, and ``negatives`` ids drawn uniformly (with replacement) from the other
    ids, each standing for ``|others| / negatives`` of them."""
    out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)  # type: ignore[operator]
    sel = batch.loss_mask[:, 1:].bool()
    h = out.last_hidden_state[:, :-1][sel]
    y = batch.input_ids[:, 1:][sel]
    weight = output_embeddings(model)
    vocab = weight.shape[0]
    positive = torch.unique(y)
    drawn = torch.randint(0, vocab, (negatives,), generator=gen)
    drawn = drawn[~torch.isin(drawn, positive)]
    cols = torch.cat([positive, drawn])
    logits = h @ weight[cols].t()
    if drawn.numel():
        logits[:, positive.numel() :] += math.log((vocab - positive.numel()) / drawn.numel())
    return nn.functional.cross_entropy(logits, torch.searchsorted(positive, y))


@functools.cache
def digit_ids() -> frozenset[int]:
    """The ids of the tokens ``0`` to ``9`` (the Qwen tokenizer writes every digit as a token of its own)."""
    return frozenset(i for d in range(10) for i in encode(str(d)))


def copy_sequence(task: MathTask, prompt: str) -> Flat:
    """The first phase's sequence: the reference script after the prompt without the system text, scored
    on the digits of the outputs only."""
    f = reference_sequence(task, prompt.replace(SYSTEM, "", 1))
    digits = torch.tensor([int(i) in digit_ids() for i in f.ids.tolist()], dtype=torch.float32)
    return Flat(f.ids, f.loss_mask * digits, f.behaviour_logprobs)


def _lr_at(step: int, steps: int, cfg: WarmStartConfig, lr: float) -> float:
    if step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
    return lr * (cfg.final_lr_frac + (1 - cfg.final_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def fit(
    model: nn.Module,
    draw: Callable[[int], Batch],
    steps: int,
    lr: float,
    cfg: WarmStartConfig,
    log: Callable[[dict[str, float]], None] | None = None,
    stop: Callable[[int, float], bool] | None = None,
) -> dict[str, float]:
    """Supervised fitting: up to ``steps`` AdamW steps, each on ``draw(step)``'s batch, minimising the
    token-mean negative log-likelihood of its scored tokens (``cfg``'s schedule, clipping and sampled
    softmax), until ``stop(step, loss)`` says so. Returns the steps taken, losses and timings; ``log``
    (optional) gets each step's metrics."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, fused=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    t0 = time.perf_counter()
    losses: list[float] = []
    tokens = 0
    for step in range(steps):
        b = draw(step)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, cfg, lr)
        if cfg.negatives is None:
            loss = -sequence_logprobs(model, b, 1.0, cfg.head_chunk).mean()
        else:
            loss = sampled_nll(model, b, cfg.negatives, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        tokens += int(b.loss_mask.sum())
        if log is not None:
            log(
                {
                    "step": float(step),
                    "loss": losses[-1],
                    "grad_norm": float(norm),
                    "lr": _lr_at(step, steps, cfg, lr),
                }
            )
        if stop is not None and stop(step, losses[-1]):
            break
    model.eval()
    elapsed = time.perf_counter() - t0
    tail = losses[-min(20, len(losses)) :] if losses else [math.nan]
    return {
        "steps": float(len(losses)),
        "loss": losses[-1] if losses else math.nan,
        "tail_loss": sum(tail) / len(tail),
        "first_loss": losses[0] if losses else math.nan,
        "seconds": elapsed,
        "seconds_per_step": elapsed / max(1, len(losses)),
        "output_tokens": float(tokens),
    }


def warm_start(
    model: nn.Module,
    tasks: Sequence[MathTask],
    steps: int = WarmStartConfig.steps,
    batch: int = WarmStartConfig.batch,
    lr: float = WarmStartConfig.lr,
    seed: int = WarmStartConfig.seed,
    cfg: WarmStartConfig | None = None,
    log: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Train ``model`` for ``steps`` AdamW steps of ``batch`` reference sequences drawn (seeded) from
    ``tasks`` (``fit``): the first ``cfg.copy_steps`` on ``copy_sequence``s, the rest on
    ``reference_sequence``s until a step's loss is at most ``cfg.target_loss``. Returns the steps taken, the
    last loss and timings; ``log`` (optional) gets each step's metrics with its phase."""
    cfg = replace(cfg or WarmStartConfig(), seed=seed)
    if not tasks:
        raise ValueError("a warm start needs tasks")
    rng = random.Random(seed)
    texts = prompts(tasks)
    cache: dict[tuple[bool, int], Flat] = {}
    copy_steps = min(cfg.copy_steps, steps)

    def draw(step: int) -> Batch:
        copy = step < copy_steps
        picked = [(copy, rng.randrange(len(tasks))) for _ in range(batch)]
        for key in picked:
            if key not in cache:
                make = copy_sequence if copy else reference_sequence
                cache[key] = make(tasks[key[1]], texts[key[1]])
        return collate([cache[k] for k in picked], [0.0] * batch)

    def logged(m: dict[str, float]) -> None:
        if log is not None:
            log({**m, "phase": 1.0 if m["step"] < copy_steps else 2.0})

    target = cfg.target_loss
    out = fit(
        model,
        draw,
        steps,
        lr,
        cfg,
        logged,
        stop=lambda step, loss: step >= copy_steps and target is not None and loss <= target,
    )
    reached = target is not None and out["loss"] <= target and out["steps"] > copy_steps
    return {**out, "copy_steps": float(copy_steps), "reached_target": float(reached)}

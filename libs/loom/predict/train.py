"""Training the length regressor: AdamW on standardised log(1 + remaining), early stopping on the validation
split, a checkpoint after every epoch that ``resume`` picks up, and a budget of optimiser steps.

The budget is counted in steps, never in wall-clock time, and the run is seeded and single-ordered (a fixed
number of threads, deterministic kernels): the same examples, budget and seed give the same model on a fast
machine and on a slow or busy one. A minute's budget once gave a slower machine a model a third as trained,
and every benchmark that cross-fits the predictor moved with it."""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from loom.predict import context, regressor
from loom.predict.dataset import Example
from loom.predict.regressor import PAD_ID, LengthRegressor

PRIOR_FOLDS = 5
# The summary is kept at a step only if it wins on the validation trajectories in this share of bootstrap
# resamples. A few dozen validation tasks cannot tell a small gain from the noise of a model that has
# memorised its training tasks, and where they cannot, the simpler head (prior and features) is the safer
# bet on tasks it never saw.
GATE_CONFIDENCE = 0.9


@dataclass
class TrainConfig:
    base: str = "tiny"
    epochs: int = 30
    batch_size: int = 32
    lr: float | None = None  # 2e-3 from scratch, 3e-5 for a pretrained checkpoint
    weight_decay: float = 0.01
    # Optimiser steps (batches) in all; None: the epochs and early stopping alone end it. The learning-rate
    # schedule is laid over the budget, so a short budget still ends at a low rate.
    max_steps: int | None = None
    patience: int = 6
    seed: int = 0
    # Intra-op threads: a matmul's sums are split by thread, so a model is reproducible only at one count.
    threads: int = 2
    # Random, frozen token embeddings (random features of the bag of tokens) generalised worse than
    # trained ones on the SWE split; kept as an option for smaller trace sets.
    freeze_embeddings: bool = False
    # Share of context tokens hidden from each training example, a fresh draw every time it is seen.
    token_dropout: float = 0.3
    # The bag-of-tokens prior: ridge penalty, and the steps whose contexts it is fitted on.
    prior_alpha: float = 1.0
    prior_steps: int = 2
    # Example weight (k + 1) ** -early_weight at step k. Every step of a trajectory shares its prompt, so
    # the late steps, which far outnumber the early ones, would otherwise decide what the text means.
    early_weight: float = 1.0


@dataclass
class TrainReport:
    epochs: int
    steps: int
    train_loss: float
    val_loss: float
    best_epoch: int
    seconds: float
    examples: int
    text_gates: list[float] = field(default_factory=list)


def tensors(examples: Sequence[Example], pool: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask, feats = context.inputs(examples, PAD_ID, pool)
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(feats)


def targets(examples: Sequence[Example]) -> torch.Tensor:
    return torch.tensor([math.log1p(e.remaining) for e in examples], dtype=torch.float32)


def standard_targets(model: LengthRegressor, examples: Sequence[Example]) -> torch.Tensor:
    """Targets in the standard units the head predicts in."""
    return (targets(examples) - model.mean) / model.std


def fit_prior(model: LengthRegressor, examples: Sequence[Example], cfg: TrainConfig) -> torch.Tensor:
    """Fit the model's bag-of-tokens prior on the examples of steps up to ``cfg.prior_steps`` (the prompt
    and the first plan, Heddle's strong early indicator) and return each training example's prior from
    the ridge fitted without its task's fold (cross-fitting), so that the head sees how well the prior
    does on tasks it never saw, as it will in service."""
    buckets = model.cfg.bag_buckets
    if not buckets:
        return torch.zeros(len(examples))
    early = [e for e in examples if e.step <= cfg.prior_steps]
    x = _bags(early, model, buckets).double()
    y = torch.tensor([math.log1p(e.total) for e in early], dtype=torch.float64)
    beta, mean = _ridge(x, y, cfg.prior_alpha)
    model.bag_beta.copy_(beta.float())
    model.bag_mean.fill_(float(mean))
    tasks = sorted({e.task_id for e in examples})
    folds = min(PRIOR_FOLDS, len(tasks))
    if folds < 2:
        return torch.full((len(examples),), float(mean))
    fold_of = {t: zlib.crc32(t.encode()) % folds for t in tasks}
    fitted = []
    for f in range(folds):
        keep = torch.tensor([fold_of[e.task_id] != f for e in early])
        fitted.append(_ridge(x[keep], y[keep], cfg.prior_alpha))
    betas = torch.stack([b for b, _ in fitted], dim=1).float()
    means = torch.tensor([m for _, m in fitted], dtype=torch.float32)
    out = torch.empty(len(examples))
    for i in range(0, len(examples), 256):
        chunk = examples[i : i + 256]
        scores = _bags(chunk, model, buckets) @ betas + means
        pick = torch.tensor([fold_of[e.task_id] for e in chunk])
        out[i : i + len(chunk)] = scores.gather(1, pick.unsqueeze(1)).squeeze(1)
    return out


def _bags(examples: Sequence[Example], model: LengthRegressor, buckets: int) -> torch.Tensor:
    parts = []
    for i in range(0, len(examples), 256):
        ids, mask, _ = tensors(examples[i : i + 256], model.cfg.pool)
        parts.append(regressor.bag_features(ids, mask, buckets))
    return torch.cat(parts) if parts else torch.zeros(0, buckets)


def _ridge(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
    """Ridge regression in its dual form (a few hundred examples, thousands of buckets): (beta, mean)."""
    if not len(y):
        return torch.zeros(x.shape[1], dtype=torch.float64), 0.0
    mean = float(y.mean())
    gram = x @ x.T + alpha * torch.eye(len(y), dtype=torch.float64)
    return x.T @ torch.linalg.solve(gram, y - mean), mean


def select_text_gates(model: LengthRegressor, val: Sequence[Example], batch_size: int) -> list[float]:
    """Per gate (a range of steps), keep the transformer's summary only if the held-out tasks are
    predicted clearly better with it than with the prior and features alone."""
    gates = model.text_gate
    serving = gate_of(model, val)
    for k in range(len(gates)):
        chosen = [e for e, g in zip(val, serving, strict=True) if g == k]
        if not chosen:
            continue
        errors = []
        for on in (0.0, 1.0):
            gates[k] = on
            errors.append(_errors(model, chosen, batch_size))
        wins = summary_wins(errors[0], errors[1], [e.traj_id for e in chosen])
        gates[k] = 1.0 if wins >= GATE_CONFIDENCE else 0.0
    return gates.tolist()


def gate_of(model: LengthRegressor, examples: Sequence[Example]) -> list[int]:
    """The gate serving each example, as the model maps it."""
    if not examples:
        return []
    return model.gate_of(torch.from_numpy(np.stack([e.features for e in examples]))).tolist()


def summary_wins(
    off: np.ndarray, on: np.ndarray, trajectories: Sequence[str], samples: int = 2000, seed: int = 0
) -> float:
    """Share of bootstrap resamples of the trajectories in which the errors with the summary (``on``) are
    below those without it (``off``) on average; a trajectory's steps are drawn together."""
    ids = sorted(set(trajectories))
    index = {t: i for i, t in enumerate(ids)}
    which = np.array([index[t] for t in trajectories])
    gain = np.bincount(which, off - on, len(ids)) / np.bincount(which, minlength=len(ids))
    rng = np.random.default_rng(seed)
    means = gain[rng.integers(0, len(ids), (samples, len(ids)))].mean(1)
    return float(np.mean(means > 0))


def _errors(model: LengthRegressor, examples: Sequence[Example], batch_size: int) -> np.ndarray:
    """Squared errors in standard units, the model evaluated as it serves and left in the mode it was in."""
    training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            z = model.standard(*tensors(chunk, model.cfg.pool))
            out.append(((z - standard_targets(model, chunk)) ** 2).numpy())
    model.train(training)
    return np.concatenate(out) if out else np.zeros(0)


def _val_loss(model: LengthRegressor, val: Sequence[Example], batch_size: int) -> float:
    return float(_errors(model, val, batch_size).mean()) if val else float("nan")


def train(
    train_set: Sequence[Example],
    val_set: Sequence[Example],
    cfg: TrainConfig,
    out: Path,
    resume: bool = False,
    on_step: Callable[[int, int, float], None] | None = None,
) -> TrainReport:
    """Fit a regressor to ``train_set``, keep the epoch with the lowest validation loss in ``out``.

    ``on_step(step, planned, loss)`` reports progress (a progress bar, say)."""
    if not train_set:
        raise ValueError("no training examples")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ValueError("max_steps must be at least 1")
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _train(train_set, val_set, cfg, out, resume, on_step)
    finally:  # the process's own settings back: a benchmark trains folds and then runs on its threads
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(
    train_set: Sequence[Example],
    val_set: Sequence[Example],
    cfg: TrainConfig,
    out: Path,
    resume: bool,
    on_step: Callable[[int, int, float], None] | None,
) -> TrainReport:
    started = time.monotonic()
    state_path = out / "train_state.pt"
    model = regressor.build(cfg.base, cfg.seed)
    y = targets(train_set)
    model.mean.fill_(float(y.mean()))
    model.std.fill_(max(float(y.std()), 1e-3))
    priors = fit_prior(model, train_set, cfg)
    lr = cfg.lr if cfg.lr is not None else (2e-3 if cfg.base == "tiny" else 3e-5)
    if cfg.freeze_embeddings and cfg.base == "tiny":
        model.backbone.embed_tokens.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    planned = per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        planned = min(planned, cfg.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / planned)))
    )
    epoch, step, best, best_epoch, stale = 0, 0, float("inf"), -1, 0
    if resume and state_path.exists():
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        epoch, step, best, best_epoch, stale = (
            st["epoch"],
            st["step"],
            st["best"],
            st["best_epoch"],
            st["stale"],
        )
    rng = np.random.default_rng(cfg.seed + epoch)
    model.train()
    train_loss = float("nan")
    while epoch < cfg.epochs and stale < cfg.patience:
        order = rng.permutation(len(train_set))
        losses = []
        for i in range(0, len(order), cfg.batch_size):
            picked = order[i : i + cfg.batch_size]
            chunk = [train_set[j] for j in picked]
            ids, mask, feats = tensors(chunk, model.cfg.pool)
            if cfg.token_dropout:
                drop = (torch.rand(mask.shape) < cfg.token_dropout) & (mask > 0)
                ids, mask = ids.masked_fill(drop, PAD_ID), mask.masked_fill(drop, 0)
            z = model.standard(ids, mask, feats, priors[torch.from_numpy(picked)])
            w = torch.tensor([(e.step + 1.0) ** -cfg.early_weight for e in chunk])
            err = (z - standard_targets(model, chunk)) ** 2
            loss = (w * err).sum() / w.sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            if on_step:
                on_step(step, planned, losses[-1])
            if step >= planned:
                break
        epoch += 1
        train_loss = float(np.mean(losses)) if losses else float("nan")
        val = _val_loss(model, val_set, cfg.batch_size)
        # With no validation split, the last epoch is the one kept.
        if not val_set or val < best:
            best, best_epoch, stale = val, epoch, 0
            regressor.save(model, out)
        else:
            stale += 1
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "epoch": epoch,
                "step": step,
                "best": best,
                "best_epoch": best_epoch,
                "stale": stale,
            },
            state_path,
        )
        if step >= planned:
            break
    gates: list[float] = []
    if val_set and (out / "model.pt").exists():
        kept = regressor.load(out)
        gates = select_text_gates(kept, val_set, cfg.batch_size)
        regressor.save(kept, out)
    return TrainReport(
        text_gates=gates,
        epochs=epoch,
        steps=step,
        train_loss=train_loss,
        val_loss=best,
        best_epoch=best_epoch,
        seconds=time.monotonic() - started,
        examples=len(train_set),
    )

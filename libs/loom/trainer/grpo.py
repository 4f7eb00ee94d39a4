"""GRPO for Loom's trajectories: the math only (pure torch, no I/O).

A trajectory becomes one token sequence (``flatten``): every step's ``prompt_ids`` then its ``output_ids``,
exactly the context the engine saw (``loom.envs.transcript``), with the loss on the output ids only and the
engine's sampling log-probabilities beside them. Rewards become group-relative advantages
(``group_advantages``). One optimizer step (``train_step``) minimises the decoupled PPO objective that AReaL
and verl use for off-policy samples (Hilton et al., "Batch size-invariance for policy optimization"; AReaL,
Fu et al. 2025): for every output token t of a sequence with advantage A,

    ratio_t = pi_theta(y_t) / pi_old(y_t)                       (pi_old: these weights before the step)
    w_t     = min(pi_old(y_t) / pi_behaviour(y_t), is_cap)      (truncated importance weight, no gradient)
    loss_t  = -w_t * min(ratio_t * A, clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high) * A)
              + kl_coef * KL_t(pi_theta || pi_ref)              (k3 estimator; off by default)

``pi_behaviour`` is whatever weights sampled the token (the engine's ``output_logprobs``, perhaps several
weight versions old); ``pi_old`` separates "how stale the sample is" (corrected by ``w``) from "how far this
update may move the policy" (the clip). The loss is the token mean: the sum of ``loss_t`` over every output
token of the batch divided by the number of those tokens (DAPO's token-level normalisation: a long answer
weighs by its tokens); split into k minibatches, each one's sum is divided by a k-th of the batch's tokens,
as TRL does, so that every optimizer step sees a loss of the same scale.

Log-probabilities are of ``logits / temperature``, the distribution the engine sampled from, and the LM head
(151,680 rows for the Qwen vocabulary) is applied only at the positions that predict output tokens, in
chunks, recomputed in the backward pass (``head_logprobs``): the full ``[tokens, vocab]`` logits never exist.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from loom.protocol.messages import Trajectory

PAD_ID = 151_643  # <|endoftext|>: right padding, never attended to nor scored


@dataclass(frozen=True)
class GRPOConfig:
    """One RL step's recipe. The defaults are those measured to raise held-out reward on ``arith`` with the
    tiny policy on one CPU thread (see ``loom.trainer.warmstart`` for the warm start that precedes it)."""

    lr: float = 1e-4
    groups_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    # Truncation of the importance weight pi_old / pi_behaviour (samples of older weights).
    is_cap: float = 2.0
    # Divide the group-centred reward by the group's std (GRPO); False keeps only the centring (Dr. GRPO).
    scale_std: bool = True
    std_eps: float = 1e-6
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    # Train the token embeddings / LM head too (see ``make_optimizer``).
    train_embeddings: bool = False
    # Optimizer steps per batch, over equal slices of its sequences; pi_old is the weights before the first.
    minibatches: int = 1
    # How the per-token losses of a minibatch add up, named as TRL names them (GRPOConfig.loss_type):
    # "dapo": summed over the minibatch, divided by the scored tokens of the whole batch over the number of
    # minibatches, a minibatch's share (DAPO, Loom's default; TRL divides by num_items_in_batch over
    # steps_per_generation);
    # "bnpo": divided by the minibatch's scored tokens; "grpo": each sequence's mean, averaged over the
    # minibatch's sequences (the GRPO paper); "dr_grpo": summed, divided by the minibatch's sequences times
    # ``max_completion_length`` (Dr. GRPO).
    loss_type: Literal["dapo", "bnpo", "grpo", "dr_grpo"] = "dapo"
    # Dr. GRPO's constant; None: the longest scored span of the batch.
    max_completion_length: int | None = None
    # Positions per LM-head chunk (memory: chunk x vocab floats).
    head_chunk: int = 256
    max_new_tokens: int = 48
    steps: int = 16


class Flat(NamedTuple):
    """A trajectory as one sequence: token ids, 1 where the token is the model's output, and the sampling
    log-probability of each output token (0 elsewhere)."""

    ids: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor


def flatten(traj: Trajectory) -> Flat:
    """The trajectory's token sequence: each step's ``prompt_ids`` then its ``output_ids``.

    ValueError (naming the trajectory and step) when a step lacks token ids or log-probabilities: such a
    trajectory came from an engine that returns no ids (the simulated one) or a job that did not ask for
    ``sampling.logprobs``."""
    if not traj.steps:
        raise ValueError(f"trajectory {traj.traj_id}: no steps to train on")
    ids: list[int] = []
    mask: list[float] = []
    lps: list[float] = []
    for s in traj.steps:
        where = f"trajectory {traj.traj_id} step {s.index}"
        if s.prompt_ids is None or s.output_ids is None:
            raise ValueError(f"{where} has no token ids: train on a live job's trajectories (a real engine)")
        if s.output_logprobs is None:
            raise ValueError(f"{where} has no output log-probabilities: run the job with sampling.logprobs")
        if len(s.output_logprobs) != len(s.output_ids):
            raise ValueError(
                f"{where}: {len(s.output_logprobs)} log-probabilities for {len(s.output_ids)} output ids"
            )
        if s.rebased:
            raise ValueError(f"{where}: the agent rewrote its history here; the steps are not one sequence")
        if not ids and not s.prompt_ids:
            raise ValueError(f"{where}: the first call has no prompt to condition on")
        ids += s.prompt_ids
        mask += [0.0] * len(s.prompt_ids)
        lps += [0.0] * len(s.prompt_ids)
        ids += s.output_ids
        mask += [1.0] * len(s.output_ids)
        lps += s.output_logprobs
    return Flat(
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(mask, dtype=torch.float32),
        torch.tensor(lps, dtype=torch.float32),
    )


def group_advantages(
    rewards: Tensor | Sequence[float],
    groups: Sequence[Hashable],
    scale_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, divided by the group's (sample) std
    plus ``eps`` when ``scale_std``. A group whose rewards are all equal (or a group of one) gets zero: it
    says nothing about which sample was better."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1 or len(groups) != r.numel():
        raise ValueError(f"{r.numel()} rewards for {len(groups)} group labels")
    out = torch.zeros_like(r)
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    for idx in members.values():
        x = r[idx]
        if len(idx) < 2 or bool((x == x[0]).all()):
            continue
        a = x - x.mean()
        if scale_std:
            a = a / (x.std() + eps)
        out[idx] = a
    return out.float()


# ---------------------------------------------------------------- the LM head at chosen positions


# The gradient of the loss in each log-probability, computed from the log-probabilities themselves (see
# ``head_logprobs``): called per chunk with the chunk's log-probabilities and its slice of positions.
GradOf = Callable[[Tensor, slice], Tensor]


class _HeadLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[y] for rows of ``h``, in chunks; the backward pass recomputes each chunk's
    logits instead of keeping ``[n, vocab]`` of them. A chunk's logits are laid out ``[vocab, chunk]``
    (``W @ h^T``: the faster product on a CPU) and reduced in place.

    With ``grad_of``, the forward pass also computes the input gradients for the incoming gradient that
    ``grad_of`` predicts, while it has the logits; the backward pass returns them if the gradient that
    arrives is that one (else it recomputes, as without)."""

    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        weight: Tensor,
        targets: Tensor,
        inv_temp: float,
        chunk: int,
        grad_of: GradOf | None,
    ) -> Tensor:
        n, vocab = h.shape[0], weight.shape[0]
        out = h.new_empty(n)
        lse = h.new_empty(n)
        hs = h * inv_temp
        buf = h.new_empty(vocab * min(chunk, n))
        early = grad_of is not None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        expected = h.new_empty(n) if early else None
        gh = torch.empty_like(hs) if early and ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if early and ctx.needs_input_grad[1] else None
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            logits = buf[: vocab * (j - i)].view(vocab, j - i)
            torch.mm(weight, hs[i:j].t(), out=logits)
            picked = logits.gather(0, targets[None, i:j])[0]
            top = logits.amax(0)
            e = logits.sub_(top).exp_()
            total = e.sum(0)
            lse[i:j] = total.log() + top
            out[i:j] = picked - lse[i:j]
            if expected is not None and grad_of is not None:
                g = grad_of(out[i:j], slice(i, j)).to(h.dtype)
                expected[i:j] = g
                d = e.mul_(-(g / total)[None])
                _accumulate(d, targets[i:j], g, weight, hs[i:j], None if gh is None else gh[i:j], gw)
        ctx.save_for_backward(hs, weight, targets, lse)
        ctx.inv_temp, ctx.chunk = inv_temp, chunk
        ctx.early = (expected, gh, gw)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        hs, weight, targets, lse = ctx.saved_tensors
        expected, gh, gw = ctx.early
        ctx.early = None
        if expected is None or not torch.allclose(grad, expected, rtol=1e-4, atol=1e-10):
            chunk = ctx.chunk
            n, vocab = hs.shape[0], weight.shape[0]
            gh = torch.empty_like(hs) if ctx.needs_input_grad[0] else None
            gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
            buf = hs.new_empty(vocab * min(chunk, n))
            for i in range(0, n, chunk):
                j = min(i + chunk, n)
                g = grad[i:j].to(hs.dtype)
                d = buf[: vocab * (j - i)].view(vocab, j - i)
                torch.mm(weight, hs[i:j].t(), out=d)
                d.sub_(lse[None, i:j]).exp_().mul_(-g[None])
                _accumulate(d, targets[i:j], g, weight, hs[i:j], None if gh is None else gh[i:j], gw)
        if gh is not None:
            gh = gh * ctx.inv_temp
        return gh, gw, None, None, None, None


def _accumulate(
    d: Tensor, targets: Tensor, g: Tensor, weight: Tensor, hs: Tensor, gh: Tensor | None, gw: Tensor | None
) -> None:
    """Given ``d = -g * softmax`` (``[vocab, m]``), add ``g`` at the targets (d logp_y / d logits is
    onehot(y) - softmax, times the incoming gradient) and take the products into ``gh`` (before the
    temperature) and ``gw``, those that are wanted."""
    d.scatter_add_(0, targets[None], g[None])
    if gh is not None:
        torch.mm(d.t(), weight, out=gh)
    if gw is not None:
        gw.addmm_(d, hs)


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk: int = 256,
    grad_of: GradOf | None = None,
) -> Tensor:
    """Log-probabilities of ``targets`` under ``softmax(hidden @ weight.T / temperature)``, row by row,
    without materialising the logits of all rows at once (differentiable in ``hidden`` and ``weight``).

    ``grad_of(logp_chunk, positions)``, when the caller knows how the loss will depend on each
    log-probability, predicts the gradient that the backward pass will bring: the products are then done in
    the forward pass while the logits are at hand, saving a fourth of the work (a wrong prediction is
    detected and costs only the time)."""
    if temperature <= 0:
        raise ValueError("temperature must be positive: a greedy policy has no log-probabilities")
    out: Tensor = _HeadLogprobs.apply(hidden, weight, targets, 1.0 / temperature, max(1, chunk), grad_of)
    return out


# ---------------------------------------------------------------- batches


class Batch(NamedTuple):
    """Right-padded sequences: ``input_ids``/``attention_mask``/``loss_mask``/``behaviour_logprobs`` are
    ``[B, L]``; ``advantages`` is ``[B]``."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor

    def select(self, rows: Tensor) -> Batch:
        """These rows, trimmed to their longest sequence."""
        length = int(self.attention_mask[rows].sum(1).max().item()) if rows.numel() else 0
        ids, att, mask, lps = (t[rows][:, :length] for t in self[:4])
        return Batch(ids, att, mask, lps, self.advantages[rows])


def collate(flats: Sequence[Flat], advantages: Tensor | Sequence[float], pad_id: int = PAD_ID) -> Batch:
    """Right-pad variable-length sequences into a batch (padding has attention and loss mask 0)."""
    if not flats:
        raise ValueError("an empty batch")
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    if adv.shape != (len(flats),):
        raise ValueError(f"{adv.numel()} advantages for {len(flats)} sequences")
    length = max(len(f.ids) for f in flats)
    b = len(flats)
    ids = torch.full((b, length), pad_id, dtype=torch.long)
    att = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, length))
    lps = torch.zeros((b, length))
    for i, f in enumerate(flats):
        n = len(f.ids)
        ids[i, :n] = f.ids
        att[i, :n] = 1
        mask[i, :n] = f.loss_mask
        lps[i, :n] = f.behaviour_logprobs
    return Batch(ids, att, mask, lps, adv)


def output_embeddings(model: nn.Module) -> Tensor:
    head = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError("expected a causal LM whose head is a bias-free nn.Linear (Qwen3)")
    return head.weight


def sequence_logprobs(
    model: nn.Module, batch: Batch, temperature: float, chunk: int = 256, grad_of: GradOf | None = None
) -> Tensor:
    """The model's log-probability of every scored token (``loss_mask`` 1) of the batch, at ``temperature``,
    flattened in row-major order: ``[batch.loss_mask.sum()]`` (``grad_of``: see ``head_logprobs``)."""
    out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)  # type: ignore[operator]
    hidden = out.last_hidden_state
    # The hidden state at position t predicts the token at t + 1.
    sel = batch.loss_mask[:, 1:].bool()
    if bool(batch.loss_mask[:, 0].any()):
        raise ValueError("a sequence starts with a scored token: it has no context to predict it from")
    h = hidden[:, :-1][sel]
    y = batch.input_ids[:, 1:][sel]
    return head_logprobs(h, output_embeddings(model), y, temperature, chunk, grad_of)


# ---------------------------------------------------------------- the objective


def grpo_loss(
    logp: Tensor,
    logp_old: Tensor,
    logp_behaviour: Tensor,
    advantages: Tensor,
    cfg: GRPOConfig,
    n_tokens: int | None = None,
    logp_ref: Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The decoupled PPO loss over scored tokens (all ``[n]``; ``advantages`` per token), summed and divided
    by ``n_tokens`` (default: ``n``; pass the whole batch's count when this is one minibatch of it), or, given
    ``weights`` (``[n]``, see ``token_weights``), each token's loss times its weight, summed."""
    n = logp.numel()
    denom = float(n_tokens if n_tokens is not None else n)
    if n == 0:
        return logp.sum() * 0.0, {"clip_frac": 0.0, "is_weight": 0.0, "is_truncated": 0.0, "kl": 0.0}
    ratio = torch.exp(logp - logp_old)
    w = torch.exp(logp_old - logp_behaviour).clamp(max=cfg.is_cap).detach()
    surr = ratio * advantages
    clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high) * advantages
    per_token = -w * torch.minimum(surr, clipped)
    kl_mean = 0.0
    if cfg.kl_coef > 0:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probabilities")
        d = logp_ref - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + cfg.kl_coef * kl
        kl_mean = float(kl.mean())
    loss = (per_token * weights).sum() if weights is not None else per_token.sum() / max(denom, 1.0)
    with torch.no_grad():
        clip_frac = float((clipped < surr).float().mean())
        raw = torch.exp(logp_old - logp_behaviour)
        stats = {
            "clip_frac": clip_frac,
            "is_weight": float(w.mean()),
            "is_truncated": float((raw > cfg.is_cap).float().mean()),
            "kl": kl_mean,
        }
    return loss, stats


def make_optimizer(model: nn.Module, cfg: GRPOConfig) -> torch.optim.Optimizer:
    """AdamW over what RL trains, as the recipe uses it. Unless ``cfg.train_embeddings``, this freezes the
    token embeddings and the LM head (``requires_grad`` off; tied in the tiny policy): Adam moves every
    parameter by about ``lr`` whatever its gradient's size, and the 151,680 vocabulary rows, all with tiny
    gradients through the softmax, then drift together (measured: lr 1e-3 over all weights halved the
    reward in one step). Freezing them also skips the head's weight-gradient product and the optimizer's work
    on 19.4M of the tiny policy's 20.3M parameters. Fused where torch has a fused kernel."""
    if not cfg.train_embeddings:
        for module in (model.get_input_embeddings(), model.get_output_embeddings()):  # type: ignore[operator]
            module.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    kw: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas, "weight_decay": cfg.weight_decay}
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, **kw)


def _on_policy_grad(behaviour: Tensor, adv: Tensor, is_cap: float, weights: Tensor) -> GradOf:
    """The gradient of ``grpo_loss`` (KL term off) in each logp_t when pi_old = pi_theta: -w_t A_t weight_t."""

    def grad_of(logp: Tensor, at: slice) -> Tensor:
        w = torch.exp(logp - behaviour[at]).clamp(max=is_cap)
        return -(w * adv[at]) * weights[at]

    return grad_of


def token_weights(
    loss_mask: Tensor, rows: Tensor, minibatch: Tensor, n_tokens: int, cfg: GRPOConfig, parts: int = 1
) -> Tensor:
    """The weight of each scored token of ``rows`` (row-major order) in the loss of the minibatch of sequences
    ``minibatch`` (``rows`` are those of it run through the model), as ``cfg.loss_type`` adds them up;
    ``n_tokens``: the scored tokens of the whole batch, split into ``parts`` minibatches."""
    scored = loss_mask[rows, 1:]
    per_row = scored.sum(1, keepdim=True).expand_as(scored)[scored.bool()]
    ones = torch.ones_like(per_row)
    sequences = max(minibatch.numel(), 1)
    if cfg.loss_type == "dapo":
        # Every minibatch's loss has the scale of the batch's token mean, however tokens fall between them.
        return ones * parts / max(n_tokens, 1)
    if cfg.loss_type == "bnpo":
        return ones / max(float(loss_mask[minibatch, 1:].sum()), 1.0)
    if cfg.loss_type == "grpo":
        return 1.0 / (per_row.clamp(min=1.0) * sequences)
    length = cfg.max_completion_length or int(loss_mask[:, 1:].sum(1).max().item())
    return ones / (sequences * max(length, 1))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: GRPOConfig,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    """One RL update on a batch (``cfg.minibatches`` optimizer steps): metrics of it.

    Sequences whose advantage is 0 contribute nothing to the loss but their tokens to its denominator (the
    token mean is over the whole batch); with the KL term off they are not run through the model at all.
    With one minibatch, pi_old is this very forward pass, detached (the same weights: a second no-grad pass
    would compute the same numbers); with several, it is a no-grad pass before the first step."""
    if cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("kl_coef > 0 needs a reference model")
    n_tokens = int(batch.loss_mask.sum().item())
    everyone = torch.arange(batch.input_ids.shape[0])
    minibatches = [m for m in torch.tensor_split(everyone, max(1, min(cfg.minibatches, everyone.numel())))]
    # With the KL term off, a sequence of advantage 0 has no gradient: it is never run through the model (it
    # still counts in its minibatch's denominators).
    active = [m[batch.advantages[m] != 0] if cfg.kl_coef == 0 else m for m in minibatches]
    pairs = [(m, s) for m, s in zip(minibatches, active, strict=True) if s.numel()]
    rows = torch.cat([s for _, s in pairs]) if pairs else everyone[:0]
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    old: list[Tensor | None] = [None] * len(pairs)
    if len(pairs) > 1:
        with torch.no_grad():
            old = [
                sequence_logprobs(model, batch.select(s), cfg.temperature, cfg.head_chunk) for _, s in pairs
            ]
    totals = {"loss": 0.0, "clip_frac": 0.0, "is_weight": 0.0, "is_truncated": 0.0, "kl": 0.0}
    # The trainer's log-probs under the weights it has before this update against the engine's (behaviour)
    # for the same tokens: on-policy tokens (made by the fleet at this very version) must agree.
    agree = 0.0
    grad_norm = 0.0
    entropy_sum = 0.0
    trained = 0
    for (m, s), lp_old in zip(pairs, old, strict=True):
        sub = batch.select(s)
        sel = sub.loss_mask[:, 1:].bool()
        behaviour = sub.behaviour_logprobs[:, 1:][sel]
        adv = sub.advantages[:, None].expand_as(sel)[sel]
        weights = token_weights(batch.loss_mask, s, m, n_tokens, cfg, len(minibatches))
        # pi_old is this very pass when there is one minibatch: every ratio is exactly 1, inside the clip range.
        grad_of = (
            _on_policy_grad(behaviour, adv, cfg.is_cap, weights)
            if lp_old is None and cfg.kl_coef == 0
            else None
        )
        logp = sequence_logprobs(model, sub, cfg.temperature, cfg.head_chunk, grad_of)
        logp_old = logp.detach() if lp_old is None else lp_old
        if (lp_old is not None or trained == 0) and logp_old.numel():
            agree = max(agree, float((logp_old - behaviour).abs().max()))
        ref = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref = sequence_logprobs(ref_model, sub, cfg.temperature, cfg.head_chunk)
        loss, stats = grpo_loss(logp, logp_old, behaviour, adv, cfg, n_tokens, ref, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        optimizer.step()
        k = logp.numel()
        trained += k
        totals["loss"] += float(loss.detach())
        for key in ("clip_frac", "is_weight", "is_truncated", "kl"):
            totals[key] += stats[key] * k
        entropy_sum += float(-logp.detach().sum())
        grad_norm = max(grad_norm, float(norm))
    model.eval()
    out = {
        "loss": totals["loss"],
        "grad_norm": grad_norm,
        "tokens": float(n_tokens),
        "trained_tokens": float(trained),
        "logprob_max_abs_diff": agree,
    }
    for key in ("clip_frac", "is_weight", "is_truncated", "kl"):
        out[key] = totals[key] / trained if trained else 0.0
    # -mean log pi(y_t) over the scored tokens: a Monte Carlo estimate of the per-token entropy (on-policy).
    out["entropy"] = entropy_sum / trained if trained else math.nan
    out["sequences"] = float(batch.input_ids.shape[0])
    out["trained_sequences"] = float(rows.numel())
    return out

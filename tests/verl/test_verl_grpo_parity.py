"""Loom's GRPO loss (``loom.trainer.grpo``) against verl 0.9.1's own (``core_algos``: the ``vanilla`` policy loss,
``agg_loss``, the GRPO outcome advantage, the token-level truncated importance weights of its rollout correction),
for each Loom loss type verl has a ``loss_agg_mode`` for: ``dapo`` ~ ``token-mean``, ``grpo`` ~
``seq-mean-token-mean``, ``dr_grpo`` ~ ``seq-mean-token-sum-norm`` (its horizon, the response width, as Loom's
``max_completion_length``).

verl's vanilla loss also has a dual clip (``clip_ratio_c``: a negative advantage's ratio capped at 3); Loom has
none, so the batches keep every ratio below it, and say so. A group of one sample is another difference: verl
scores it as its reward (mean 0, std 1), Loom as 0; the batches have none."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from loom import checkpoints as policy
from loom.protocol import Step, Trajectory
from loom.trainer import grpo
from loom.trainer.grpo import GRPOConfig
from tests.verl.conftest import QUIET, SMALL

pytestmark = QUIET

MODES = [("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("dr_grpo", "seq-mean-token-sum-norm")]


def _actor(cfg: GRPOConfig, mode: str) -> Any:
    from verl.workers.config import ActorConfig

    return ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=8,
        clip_ratio_low=cfg.clip_eps,
        clip_ratio_high=cfg.clip_eps_high,
        loss_agg_mode=mode,
        use_torch_compile=False,
    )


def _verl_loss(
    log_prob: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    mode: str,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's actor loss as its actor computes it: decoupled (old log-probabilities recomputed), token-level
    truncated importance sampling against the rollout's log-probabilities (``rollout_is: token``)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    weights, _ = compute_rollout_correction_weights(old - rollout, mask, "token", cfg.is_cap)
    loss_fn = get_policy_loss_fn("vanilla")
    return loss_fn(old, log_prob, advantages, mask, mode, _actor(cfg, mode), weights)  # type: ignore[no-any-return]


def _loom_loss(
    log_prob: torch.Tensor,
    old: torch.Tensor,
    rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loom's loss on the same tokens, laid out as Loom lays them out: scored tokens in row-major order, a
    sequence's loss mask one position ahead of what predicts it (a prompt token first)."""
    sel = mask.bool()
    loss_mask = torch.cat([torch.zeros(mask.shape[0], 1), mask.float()], dim=1)
    everyone = torch.arange(mask.shape[0])
    n_tokens = int(mask.sum())
    weights = grpo.token_weights(loss_mask, everyone, everyone, n_tokens, cfg)
    adv = advantages[:, None].expand_as(mask)[sel]
    return grpo.grpo_loss(log_prob[sel], old[sel], rollout[sel], adv, cfg, n_tokens, weights=weights)


def _masks(lengths: list[int], width: int) -> torch.Tensor:
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    mask[0, 3:5] = 0  # an environment's reply between two model turns
    mask[5, 1:4] = 0
    return mask


@pytest.mark.parametrize(("loss_type", "mode"), MODES)
def test_loom_loss_equals_verls_with_the_clip_and_the_truncation_binding(loss_type: str, mode: str) -> None:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    g = torch.Generator().manual_seed(0)
    width = 12
    mask = _masks([12, 9, 5, 12, 7, 12, 3, 10], width)
    uid = np.array(["a"] * 4 + ["b"] * 4, dtype=object)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25])
    scores = torch.zeros(8, width)
    scores[torch.arange(8), torch.tensor([12, 9, 5, 12, 7, 12, 3, 10]) - 1] = rewards
    advantages, _ = compute_grpo_outcome_advantage(scores, mask, uid)
    loom_adv = grpo.group_advantages(rewards, list(uid))
    torch.testing.assert_close(advantages, loom_adv[:, None] * mask, rtol=1e-6, atol=1e-6)

    old = -torch.rand(8, width, generator=g) * 3
    # Rows 4 to 7 moved far since the old weights: the clip binds there, on both sides.
    step = torch.where(torch.arange(8)[:, None] < 4, 0.05, 0.5) * torch.randn(8, width, generator=g)
    # The engine sampled with older weights still: importance weights up to e, truncated at 2.
    rollout = old - torch.randn(8, width, generator=g).clamp(-1, 1)
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=width)  # type: ignore[arg-type]
    verl_lp, loom_lp = (old + step).requires_grad_(True), (old + step).requires_grad_(True)
    verl_loss, verl_stats = _verl_loss(verl_lp, old, rollout, advantages, mask, cfg, mode)
    loom_loss, loom_stats = _loom_loss(loom_lp, old, rollout, loom_adv, mask, cfg)
    verl_loss.backward()
    loom_loss.backward()
    assert float(loom_loss.detach()) == pytest.approx(float(verl_loss.detach()), abs=1e-5)
    torch.testing.assert_close(loom_lp.grad, verl_lp.grad, rtol=1e-5, atol=1e-7)
    assert verl_stats["actor/pg_clipfrac"] > 0 and loom_stats["clip_frac"] > 0
    assert loom_stats["is_truncated"] > 0
    assert verl_stats["actor/pg_clipfrac_lower"] == 0  # the dual clip never bound: Loom has none


def _traj(group: int, sample: int, steps: list[tuple[list[int], list[int]]], reward: float) -> Trajectory:
    g = torch.Generator().manual_seed(100 * group + sample)
    made = [
        Step(
            index=i,
            prompt_len=len(p),
            output_len=len(o),
            prompt_ids=p,
            output_ids=o,
            output_logprobs=(-torch.rand(len(o), generator=g) * 2.5 - 11).tolist(),
        )
        for i, (p, o) in enumerate(steps)
    ]
    return Trajectory(
        "j", f"t{group}.{sample}", "q", group, sample, "coin", "completed", "done", made, 0.0, 0.0, reward
    )


def _trajectories() -> list[Trajectory]:
    """Two groups of three multi-turn trajectories, prompts of different lengths (verl pads them on the left);
    the engine's log-probabilities about the tiny policy's (-ln 151,680), of weights off by up to e^1.5."""
    r = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 5000, (n,), generator=r).tolist()

    shapes = [
        [(5, 4), (3, 6)],
        [(6, 7)],
        [(4, 2), (2, 3), (2, 4)],
        [(5, 9)],
        [(3, 3), (4, 5)],
        [(6, 2), (1, 6)],
    ]
    rewards = [1.0, 0.0, 0.5, 0.0, 0.0, 1.0]
    return [
        _traj(i // 3, i % 3, [(ids(p), ids(o)) for p, o in shape], rewards[i])
        for i, shape in enumerate(shapes)
    ]


@pytest.mark.parametrize(("loss_type", "mode"), MODES)
def test_verls_loss_on_loom_s_batch_equals_loom_s_trainer_on_its_trajectories(
    loss_type: str, mode: str, verl_config: Callable[..., Any]
) -> None:
    """The whole path: Loom's trajectories as the manager hands them to verl (``to_dataproto``), verl's GRPO
    advantage and its actor's log-probabilities of the responses (``logprobs_from_logits`` at the response
    positions), verl's loss; against Loom's own trainer step (``train_step``) on the same trajectories. The
    engine's log-probabilities are those of older weights: the truncated importance weights bind."""
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils.torch_functional import logprobs_from_logits

    from loom.integrations.verl import sample_of, to_dataproto
    from loom.integrations.verl.batch import objects

    trajs = _trajectories()
    width, prompt_width = 20, 8
    cfg = GRPOConfig(loss_type=loss_type, max_grad_norm=1e9, max_completion_length=width)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = policy.build_tiny(seed=0, **SMALL)
    grpo.make_optimizer(model, cfg)  # freezes what Loom does not train; verl's side trains the same

    uid = objects([f"u{t.group}" for t in trajs])
    data = to_dataproto([sample_of(t) for t in trajs], prompt_width, width, 0, non_tensor={"uid": uid})
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage(data, "grpo", num_repeat=3)
    b = data.batch
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits
    log_prob = logprobs_from_logits(logits[:, -width - 1 : -1], b["responses"])
    mask = b["response_mask"]
    loss, _ = _verl_loss(
        log_prob, log_prob.detach(), b["rollout_log_probs"], b["advantages"], mask, cfg, mode
    )
    loss.backward()
    verl_grads = [_grad(p) for p in model.parameters() if p.requires_grad]

    flats = [grpo.flatten(t) for t in trajs]
    advantages = grpo.group_advantages([t.reward or 0.0 for t in trajs], [t.group for t in trajs])
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    metrics = grpo.train_step(model, sgd, grpo.collate(flats, advantages), cfg)
    loom_grads = [_grad(p) for p in model.parameters() if p.requires_grad]

    assert metrics["is_truncated"] > 0
    assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    for a, c in zip(loom_grads, verl_grads, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)
    assert any(float(gr.abs().max()) > 0 for gr in verl_grads)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()

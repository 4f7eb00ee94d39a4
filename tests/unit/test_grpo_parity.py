"""Loom's GRPO loss against TRL's (the real package, ``GRPOTrainer._compute_loss``): on one batch of a tiny Qwen3
(multi-turn: environment tokens inside the completion, masked out), with rewards, old log-probabilities and
sampling log-probabilities of stale weights, the loss and every parameter's gradient agree for each loss type
Loom offers, named as TRL names them."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from loom import checkpoints as policy
from loom.trainer import grpo
from loom.trainer.grpo import Flat, GRPOConfig

trl = pytest.importorskip("trl", reason="the trl extra (make install installs it)")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
PROMPT, COMPLETION = 6, 9
LR = 1.0  # plain SGD: large enough that one step moves the second minibatch's ratios past the clip


def _tokenizer():
    """A word-level tokenizer made in memory: TRL's trainer needs one, though the batch comes as ids."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _reward(completions: list[str], **kwargs: object) -> list[float]:
    return [0.0] * len(completions)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Four rows: equal prompts' lengths (TRL pads prompts on the left, Loom sequences on the right: with equal
    prompts the positions agree), completions of 9, 7, 5 and 9 tokens, environment tokens inside two of them."""
    g = torch.Generator().manual_seed(seed)
    b = 4
    lengths = torch.tensor([9, 7, 5, 9])
    completion_mask = (torch.arange(COMPLETION)[None] < lengths[:, None]).long()
    env_mask = torch.ones(b, COMPLETION, dtype=torch.long)
    env_mask[0, 3:5] = 0  # an observation between two model turns
    env_mask[3, 2:6] = 0
    return {
        "prompt_ids": torch.randint(3, 5000, (b, PROMPT), generator=g),
        "completion_ids": torch.randint(3, 5000, (b, COMPLETION), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "tool_mask": env_mask,
        "advantages": torch.tensor([1.2, -0.4, -0.8, 0.0]),
    }


def _logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, PROMPT - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]


def _loom(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], behaviour: torch.Tensor, cfg: GRPOConfig
) -> tuple[float, list[torch.Tensor]]:
    mask = (batch["completion_mask"] * batch["tool_mask"]).float()
    flats = []
    for i in range(mask.shape[0]):
        n = int(batch["completion_mask"][i].sum())
        ids = torch.cat([batch["prompt_ids"][i], batch["completion_ids"][i, :n]])
        loss_mask = torch.cat([torch.zeros(PROMPT), mask[i, :n]])
        lps = torch.cat([torch.zeros(PROMPT), behaviour[i, :n] * mask[i, :n]])
        flats.append(Flat(ids, loss_mask, lps))
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    metrics = grpo.train_step(model, sgd, grpo.collate(flats, batch["advantages"]), cfg)
    return metrics["loss"], [_grad(p) for p in model.parameters() if p.requires_grad]


def _trl_trainer(
    model: torch.nn.Module, cfg: GRPOConfig, tmp: Path, per_device: int = 4, steps_per_generation: int = 1
) -> Any:
    """TRL's GRPOTrainer on ``model`` with ``cfg``'s loss, set as its vLLM path sets itself (Loom's integration
    applies the same truncated importance sampling, which is this branch of TRL's own loss)."""
    args = trl.GRPOConfig(
        output_dir=str(tmp),
        use_cpu=True,
        bf16=False,
        report_to=[],
        per_device_train_batch_size=per_device,
        steps_per_generation=steps_per_generation,
        num_generations=4,
        loss_type=cfg.loss_type,
        epsilon=cfg.clip_eps,
        epsilon_high=cfg.clip_eps_high,
        beta=0.0,
        max_completion_length=cfg.max_completion_length,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=cfg.is_cap,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=_reward,
            args=args,
            processing_class=_tokenizer(),
            train_dataset=datasets.Dataset.from_list([{"prompt": "a"}]),
        )
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _trl(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    behaviour: torch.Tensor,
    cfg: GRPOConfig,
    tmp: Path,
) -> tuple[float, list[torch.Tensor]]:
    trainer = _trl_trainer(model, cfg, tmp)
    mask = batch["completion_mask"] * batch["tool_mask"]
    old = _logprobs(model, batch)
    ratio = torch.exp(torch.nan_to_num((old - behaviour) * mask, nan=0.0)).clamp(max=cfg.is_cap)
    inputs = {
        **batch,
        "prompt_mask": torch.ones_like(batch["prompt_ids"]),
        "old_per_token_logps": old,
        "importance_sampling_ratio": ratio,
        "num_items_in_batch": mask.sum(),
    }
    model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    model.eval()
    return float(loss), [_grad(p) for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_loom_loss_and_gradients_equal_trl_for_each_loss_type(loss_type: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = policy.build_tiny(seed=0, **SMALL)
    batch = _batch(1)
    # The engine sampled with older weights: its log-probabilities differ from the trainer's by up to ~1.
    noise = torch.randn(batch["completion_ids"].shape, generator=torch.Generator().manual_seed(2))
    behaviour = _logprobs(model, batch) + 0.5 * noise
    cfg = GRPOConfig(loss_type=loss_type, max_grad_norm=1e9, max_completion_length=COMPLETION)  # type: ignore[arg-type]
    grpo.make_optimizer(model, cfg)  # freezes what Loom does not train; TRL then trains the same
    loom_loss, loom_grads = _loom(model, batch, behaviour, cfg)
    trl_loss, trl_grads = _trl(model, batch, behaviour, cfg, tmp_path)
    assert loom_loss == pytest.approx(trl_loss, abs=1e-5)
    assert len(loom_grads) == len(trl_grads)
    for a, b in zip(loom_grads, trl_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(float(g.abs().max()) > 0 for g in trl_grads)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
def test_several_minibatches_with_the_clip_binding_match_trl_step_for_step(
    loss_type: str, tmp_path: Path
) -> None:
    """Two optimizer steps on one batch (Loom's ``minibatches=2``, TRL's ``steps_per_generation=2``): the
    second half's ratios are taken against the weights before the first step, far enough from 1 that the clip
    binds; the weights after both steps agree."""
    batch = _batch(3)
    cfg = GRPOConfig(
        loss_type=loss_type,  # type: ignore[arg-type]
        max_grad_norm=1e9,
        max_completion_length=COMPLETION,
        minibatches=2,
    )
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = policy.build_tiny(seed=0, **SMALL)
        grpo.make_optimizer(m, cfg)
        models.append(m)
    noise = torch.randn(batch["completion_ids"].shape, generator=torch.Generator().manual_seed(4))
    behaviour = _logprobs(models[0], batch) + 0.3 * noise
    mask = (batch["completion_mask"] * batch["tool_mask"]).float()

    flats = []
    for i in range(mask.shape[0]):
        n = int(batch["completion_mask"][i].sum())
        ids = torch.cat([batch["prompt_ids"][i], batch["completion_ids"][i, :n]])
        lps = torch.cat([torch.zeros(PROMPT), behaviour[i, :n] * mask[i, :n]])
        flats.append(Flat(ids, torch.cat([torch.zeros(PROMPT), mask[i, :n]]), lps))
    loom_opt = torch.optim.SGD([p for p in models[0].parameters() if p.requires_grad], lr=LR)
    metrics = grpo.train_step(models[0], loom_opt, grpo.collate(flats, batch["advantages"]), cfg)
    assert metrics["clip_frac"] > 0.05, metrics  # the clip binds in the second step

    trainer = _trl_trainer(models[1], cfg, tmp_path, per_device=2, steps_per_generation=2)
    trl_opt = torch.optim.SGD([p for p in models[1].parameters() if p.requires_grad], lr=LR)
    old = _logprobs(models[1], batch)
    ratio = torch.exp(torch.nan_to_num((old - behaviour) * mask, nan=0.0)).clamp(max=cfg.is_cap)
    for rows in (slice(0, 2), slice(2, 4)):
        inputs = {k: v[rows] for k, v in batch.items()}
        inputs.update(
            prompt_mask=torch.ones_like(inputs["prompt_ids"]),
            old_per_token_logps=old[rows],
            importance_sampling_ratio=ratio[rows],
            num_items_in_batch=mask.sum(),  # TRL's: the whole generation batch's
        )
        models[1].train()
        trl_opt.zero_grad(set_to_none=True)
        trainer._compute_loss(models[1], inputs).backward()
        trl_opt.step()
    models[1].eval()
    moved = 0.0
    for a, b, p0 in zip(
        models[0].parameters(),
        models[1].parameters(),
        policy.build_tiny(seed=0, **SMALL).parameters(),
        strict=True,
    ):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
        moved = max(moved, float((a.detach() - p0).abs().max()))
    assert moved > 1e-3  # the steps did move the weights


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.clone()

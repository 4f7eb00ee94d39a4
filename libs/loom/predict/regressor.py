"""The length regressor: a Qwen3 model with a regression head, predicting log(1 + remaining tokens).

``tiny`` builds a small Qwen3 from a config, trained from scratch on a CPU in minutes. It reads the context
pooled: the mean embedding of every ``pool`` consecutive tokens is one position for the transformer, so a
2,048-token window costs 32 positions and a batch of 32 answers well within the service's latency budget
(pooling 32 tokens cost twice the transformer time, and its p99 came within noise of 30 ms on two cores).
A local checkpoint (Qwen3-0.6B, say) is fine-tuned instead with ``pool = 1``, reading every token as it
was trained to.

Beside the transformer's summary and the step features, the head reads a prior: a ridge regression of the
total length on the context's hashed bag of tokens (Heddle's "static prompt analysis", fused with the runtime
context). On the SWE traces, one run per task, a from-scratch transformer memorises the few hundred training
tasks and predicts nothing at steps 0 to 2, where such a ridge carries most of what the text says.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, Qwen3Config, Qwen3Model

from loom.predict import context

# Ordinary Qwen tokens end at 151,642; the next id (<|endoftext|> in Qwen's vocabulary) pads.
PAD_ID = 151_643
TINY = {
    "vocab_size": 151_680,
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}


# Buckets of the hashed bag of tokens behind the prior (0: no prior).
BAG_BUCKETS = 16_384
# The first step of each gate on the transformer's summary after the first (step 0): steps 0, 1, 2, 3-4,
# 5-7, 8-11, 12-19, 20-29 and 30 on. Where the summary helps changes with the step: on the SWE traces it only
# memorises up to step 10 or so, and one gate for every step from 3 let the late steps, which far outnumber
# the early ones, open it for steps 3 to 9 too.
GATE_BOUNDS = (1, 2, 3, 5, 8, 12, 20, 30)


@dataclass
class RegressorConfig:
    base: str = "tiny"
    pool: int = 64
    bag_buckets: int = BAG_BUCKETS
    backbone: dict[str, Any] = field(default_factory=lambda: dict(TINY))
    # log1p(remaining) over the training set: the head predicts in standard units.
    target_mean: float = 8.0
    target_std: float = 1.0
    head_tokens: int = context.HEAD_TOKENS
    tail_tokens: int = context.TAIL_TOKENS
    gate_bounds: list[int] = field(default_factory=lambda: list(GATE_BOUNDS))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> RegressorConfig:
        data = json.loads(path.read_text())
        data.setdefault("bag_buckets", 0)  # written before the prior existed
        data.setdefault("gate_bounds", [1, 2, 3])  # written when steps 0, 1, 2 and 3 on had a gate each
        return cls(**data)


# Eager attention exports to ONNX as plain MatMul/Softmax.
EAGER: dict[str, Any] = {"attn_implementation": "eager"}


class LengthRegressor(nn.Module):
    mean: torch.Tensor
    std: torch.Tensor
    bag_beta: torch.Tensor
    bag_mean: torch.Tensor
    text_gate: torch.Tensor
    gate_bounds: torch.Tensor

    def __init__(self, cfg: RegressorConfig, backbone: Qwen3Model | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        if backbone is None:
            qcfg = Qwen3Config(**cfg.backbone, pad_token_id=PAD_ID, **EAGER)
            backbone = Qwen3Model(qcfg)
        self.backbone = backbone
        d = backbone.config.hidden_size
        # A few hundred prompts are easy to memorise. In training the text's summary is dropped whole for
        # a share of the examples, so the step features must predict on their own and the text can only add.
        self.text_dropout = 0.5
        extra = context.N_FEATURES + (1 if cfg.bag_buckets else 0)
        self.head = nn.Sequential(nn.Linear(2 * d + extra, d), nn.GELU(), nn.Linear(d, 1))
        self.register_buffer("mean", torch.tensor(cfg.target_mean))
        self.register_buffer("std", torch.tensor(cfg.target_std))
        # The prior: a ridge regression of log(1 + total tokens) on the context's hashed bag of tokens,
        # fitted in closed form before training (``train.fit_prior``). Static text analysis that a few
        # hundred tasks can support, where the transformer memorises them; the head weighs it by step.
        self.register_buffer("bag_beta", torch.zeros(cfg.bag_buckets))
        self.register_buffer("bag_mean", torch.tensor(cfg.target_mean))
        # Whether the head reads the transformer's summary at each step, chosen on held-out tasks after
        # training (``train.select_text_gates``): where it has only memorised, the prior and features answer.
        self.register_buffer("text_gate", torch.ones(len(cfg.gate_bounds) + 1))
        self.register_buffer(
            "gate_bounds", torch.tensor(cfg.gate_bounds, dtype=torch.float32), persistent=False
        )
        with torch.no_grad():
            # Padding must add nothing to a pooled mean; real text never holds this id.
            self.backbone.embed_tokens.weight[PAD_ID].zero_()

    def prior(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The bag-of-tokens ridge's log(1 + total tokens): ``bag_features @ bag_beta + bag_mean``, summed over
        the window's tokens rather than over the buckets. Each of a bucket's c tokens carries 1/c of its
        log(1 + c) term, so the sums are the same, at a fraction of the work and memory traffic when the
        buckets far outnumber the tokens (a third of the model's latency at batch 32 went to the dense form)."""
        idx = input_ids % self.cfg.bag_buckets
        mask = attention_mask.to(torch.float32)
        counts = torch.zeros(input_ids.shape[0], self.cfg.bag_buckets, dtype=torch.float32)
        per_token = counts.scatter_add(1, idx, mask).gather(1, idx).clamp(min=1.0)
        log_count = torch.log1p(per_token)
        share = mask * log_count / per_token
        norm = (share * log_count).sum(1).clamp(min=1.0).sqrt()
        return (share * self.bag_beta[idx]).sum(1) / norm + self.bag_mean

    def standard(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        feats: torch.Tensor,
        prior: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prediction in standard units, what training fits. Training passes ``prior`` from ridges
        fitted without the example's task, so that the head learns how far the prior holds on unseen
        tasks; everywhere else the model computes it."""
        if self.cfg.bag_buckets:
            if prior is None:
                prior = self.prior(input_ids, attention_mask)
            feats = torch.cat([feats, ((prior - self.mean) / self.std).unsqueeze(-1)], dim=-1)
        p = self.cfg.pool
        emb = self.backbone.embed_tokens(input_ids)
        b, n, d = emb.shape
        if p > 1:
            counts = attention_mask.view(b, n // p, p).sum(2, keepdim=True)
            emb = emb.view(b, n // p, p, d).sum(2) / counts.to(emb.dtype).clamp(min=1.0)
            mask = (counts.squeeze(-1) > 0).to(attention_mask.dtype)
        else:
            mask = attention_mask
        out = self.backbone(inputs_embeds=emb, attention_mask=mask).last_hidden_state
        w = mask.to(out.dtype).unsqueeze(-1)
        mean = (out * w).sum(1) / w.sum(1).clamp(min=1.0)
        # Left padding: the newest position is always the last.
        text = torch.cat([mean, out[:, -1]], dim=-1)
        if self.training and self.text_dropout:
            keep = (torch.rand(b, 1) >= self.text_dropout).to(text.dtype)
            text = text * keep
        text = text * self.text_gate[self.gate_of(feats)].unsqueeze(-1)
        return self.head(torch.cat([text, feats], dim=-1)).squeeze(-1)

    def gate_of(self, feats: torch.Tensor) -> torch.Tensor:
        """The gate serving each context: how many of the bounds its step (from its features) has reached."""
        step = torch.round(torch.exp(feats[:, 0]) - 1)  # ONNX has no expm1
        return (step.unsqueeze(-1) >= self.gate_bounds).sum(-1)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        """log(1 + remaining tokens)."""
        return self.standard(input_ids, attention_mask, feats) * self.std + self.mean


def bag_features(input_ids: torch.Tensor, attention_mask: torch.Tensor, buckets: int) -> torch.Tensor:
    """Per context: log(1 + count) of its tokens in each of ``buckets`` hash buckets (id mod buckets),
    scaled to unit length (at most)."""
    counts = torch.zeros(input_ids.shape[0], buckets, dtype=torch.float32)
    counts = counts.scatter_add(1, input_ids % buckets, attention_mask.to(torch.float32))
    x = torch.log1p(counts)
    return x / x.pow(2).sum(1, keepdim=True).clamp(min=1.0).sqrt()


def build(base: str, seed: int = 0) -> LengthRegressor:
    """``tiny`` from its config, or a local Qwen3 checkpoint directory (weights as trained, ``pool = 1``)."""
    torch.manual_seed(seed)
    if base == "tiny":
        return LengthRegressor(RegressorConfig())
    path = Path(base)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--base must be 'tiny' or a local Qwen3 checkpoint directory; {path} has no config.json"
        )
    qcfg = AutoConfig.from_pretrained(path, local_files_only=True)
    if qcfg.model_type != "qwen3":
        raise ValueError(
            f"{path} holds a {qcfg.model_type!r} model; the predictor fine-tunes Qwen3 checkpoints"
        )
    qcfg.pad_token_id = PAD_ID
    backbone = AutoModel.from_pretrained(path, config=qcfg, local_files_only=True, **EAGER)
    cfg = RegressorConfig(base=str(path), pool=1, backbone={})
    return LengthRegressor(cfg, backbone)


def save(model: LengthRegressor, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    cfg.target_mean, cfg.target_std = float(model.mean), float(model.std)
    if not cfg.backbone:
        cfg.backbone = {
            k: v for k, v in model.backbone.config.to_dict().items() if k in Qwen3Config().to_dict()
        }
    cfg.save(directory / "config.json")
    torch.save(model.state_dict(), directory / "model.pt")


def load(directory: Path) -> LengthRegressor:
    cfg = RegressorConfig.load(directory / "config.json")
    backbone_cfg = {k: v for k, v in cfg.backbone.items() if k not in ("pad_token_id", "attn_implementation")}
    qcfg = Qwen3Config(**backbone_cfg, pad_token_id=PAD_ID, **EAGER)
    model = LengthRegressor(cfg, Qwen3Model(qcfg))
    state = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A checkpoint from before the gates reads the summary at every step, as it was trained to.
    if unexpected or set(missing) - {"text_gate"}:
        raise ValueError(f"{directory} does not match its config: missing {missing}, unexpected {unexpected}")
    return model.eval()

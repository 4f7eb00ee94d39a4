"""The length regressor: a Qwen3 model with a regression head, predicting log(1 + remaining tokens).

``tiny`` builds a small Qwen3 from a config, trained from scratch on a CPU in minutes. It reads the context
pooled: the mean embedding of every ``pool`` consecutive tokens is one position for the transformer, so a
2,048-token window costs 64 positions and a batch of 32 answers within the service's latency budget. A local
checkpoint (Qwen3-0.6B, say) is fine-tuned instead with ``pool = 1``, reading every token as it was trained to.
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


@dataclass
class RegressorConfig:
    base: str = "tiny"
    pool: int = 32
    backbone: dict[str, Any] = field(default_factory=lambda: dict(TINY))
    # log1p(remaining) over the training set: the head predicts in standard units.
    target_mean: float = 8.0
    target_std: float = 1.0
    head_tokens: int = context.HEAD_TOKENS
    tail_tokens: int = context.TAIL_TOKENS

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> RegressorConfig:
        return cls(**json.loads(path.read_text()))


# Eager attention exports to ONNX as plain MatMul/Softmax.
EAGER: dict[str, Any] = {"attn_implementation": "eager"}


class LengthRegressor(nn.Module):
    mean: torch.Tensor
    std: torch.Tensor

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
        self.head = nn.Sequential(nn.Linear(2 * d + context.N_FEATURES, d), nn.GELU(), nn.Linear(d, 1))
        self.register_buffer("mean", torch.tensor(cfg.target_mean))
        self.register_buffer("std", torch.tensor(cfg.target_std))
        with torch.no_grad():
            # Padding must add nothing to a pooled mean; real text never holds this id.
            self.backbone.embed_tokens.weight[PAD_ID].zero_()

    def standard(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        """The prediction in standard units, what training fits."""
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
        return self.head(torch.cat([text, feats], dim=-1)).squeeze(-1)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, feats: torch.Tensor
    ) -> torch.Tensor:
        """log(1 + remaining tokens)."""
        return self.standard(input_ids, attention_mask, feats) * self.std + self.mean


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
    model.load_state_dict(torch.load(directory / "model.pt", map_location="cpu", weights_only=True))
    return model.eval()

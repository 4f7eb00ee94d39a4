"""Policy checkpoints: a Qwen3-architecture causal LM in a directory (``config.json`` + safetensors).

Real users point Loom at a local Qwen3 checkpoint; without downloadable weights, ``build_tiny`` makes a small
Qwen3 from a config (the real vocabulary, so the Qwen tokenizer's ids mean the same thing) that trains on a
CPU in minutes. The transformers engine, the trainer and ``loom train`` all load checkpoints through here.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config
from transformers.utils import logging as hf_logging

from loom.text.tokenizer import ENDOFTEXT

# transformers patches torch's init functions process-wide while it builds a model (to skip initialising
# weights it is about to load): two loads at once on two threads leave one model with garbage weights.
_LOADING = threading.Lock()

TINY: dict[str, Any] = {
    "vocab_size": 151_680,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def tiny_config(**overrides: Any) -> Qwen3Config:
    cfg = Qwen3Config(
        **{**TINY, **overrides}, bos_token_id=ENDOFTEXT, eos_token_id=ENDOFTEXT, pad_token_id=ENDOFTEXT
    )
    cfg._attn_implementation = "eager"
    return cfg


def build_tiny(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised tiny Qwen3 causal LM (deterministic under ``seed``)."""
    with _LOADING:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(**overrides), dtype=torch.float32)
    return model.eval()


def save(model: PreTrainedModel, path: str | Path) -> Path:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    model.save_pretrained(p, safe_serialization=True)
    return p


def load(path: str | Path) -> PreTrainedModel:
    """A checkpoint directory's model in float32 on the CPU, in eval mode; a clear error when it is not one."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} is not a checkpoint directory (no config.json)")
    hf_logging.disable_progress_bar()  # a rollout worker's log is no place for a loading bar
    with _LOADING:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation="eager")
    return model.eval()

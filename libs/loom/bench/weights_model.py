"""The model the weights benchmarks move: a Qwen3 built from a config, large enough that bytes dominate."""

from __future__ import annotations

from typing import Any

# Qwen3-0.6B's layer shapes with untied embeddings (as Qwen3-8B's): two layers make 0.68 GB in BF16.
FULL = {"num_hidden_layers": 2, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936}  # fmt: skip
QUICK = {**FULL, "num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip


def build_model(quick: bool, seed: int = 0, layers: int | None = None) -> Any:
    """The benchmarks' model; ``layers`` deepens it (28 are Qwen3-0.6B's own, 1.5 GB)."""
    import torch

    from loom import checkpoints

    cfg = {**(QUICK if quick else FULL), **({"num_hidden_layers": layers} if layers else {})}
    model = checkpoints.build_tiny(seed, **cfg, tie_word_embeddings=False)
    return model.to(torch.bfloat16).eval()  # type: ignore[arg-type]

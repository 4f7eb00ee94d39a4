"""The ``disk`` transport: a Hugging Face checkpoint directory (``loom.checkpoints`` writes and reads them)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

__all__ = ["read"]


def read(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory's safetensors files (sharded or not)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out

"""Trajectory-length predictors."""

from __future__ import annotations

import os
from pathlib import Path


def default_model_path() -> Path:
    """Where ``loom predictor train`` puts the model the predictor service loads by default."""
    return Path(os.environ.get("LOOM_HOME", ".loom")) / "predictor" / "model.onnx"

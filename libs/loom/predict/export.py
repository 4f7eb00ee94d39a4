"""Export a trained regressor to ONNX, with the metadata the service needs beside it."""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from loom.predict import context, regressor
from loom.predict.dataset import Example
from loom.predict.onnx_model import meta_path
from loom.predict.regressor import PAD_ID

OPSET = 17


def export(checkpoint: Path, out: Path, method: str = "progressive") -> Path:
    """Write ``out`` (the ONNX graph) and ``out.json`` (pooling, padding, window, method); returns ``out``."""
    model = regressor.load(checkpoint)
    cfg = model.cfg
    windows = [np.arange(1, 40 * cfg.pool, dtype=np.int64), np.arange(1, 9, dtype=np.int64)]
    ids, mask = context.batch(windows, PAD_ID, cfg.pool)
    feats = np.zeros((2, context.N_FEATURES), dtype=np.float32)
    args = (torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(feats))
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python control flow in transformers
        torch.onnx.export(
            model,
            args,
            str(out),
            input_names=["input_ids", "attention_mask", "features"],
            output_names=["log_remaining"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "tokens"},
                "attention_mask": {0: "batch", 1: "tokens"},
                "features": {0: "batch"},
            },
            opset_version=OPSET,
            dynamo=False,
        )
    meta = {
        "method": method,
        "pool": cfg.pool,
        "pad_id": PAD_ID,
        "head_tokens": cfg.head_tokens,
        "tail_tokens": cfg.tail_tokens,
        "base": cfg.base,
    }
    meta_path(out).write_text(json.dumps(meta, indent=2))
    return out


def calibrate(
    onnx_path: Path, first_steps: Sequence[Example], workloads: Sequence[str] | None = None
) -> tuple[float, float]:
    """Measure the exported model at admission on held-out first steps, its error (log sd) and how much of
    its ranking is real (slope, within each of ``workloads`` where given), and record both in its metadata:
    the service weighs the model against a prompt's finished samples by the first, and placement trusts its
    differences by the second."""
    from loom.predict.onnx_model import OnnxRegressor

    sd, slope = OnnxRegressor(onnx_path).admission_fit(first_steps, workloads)
    meta = json.loads(meta_path(onnx_path).read_text())
    meta["admission_log_sd"] = round(sd, 4)
    meta["admission_slope"] = round(slope, 4)
    meta_path(onnx_path).write_text(json.dumps(meta, indent=2))
    return sd, slope

"""The exported length regressor under ONNX Runtime: what the predictor service and the benchmark run.

No torch here: the service needs only onnxruntime, numpy and the tokenizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from loom.predict import context
from loom.predict.combine import FORMAT, Combiner
from loom.predict.dataset import Example
from loom.predict.evaluate import log_error_sd, log_slope
from loom.text.tokenizer import qwen_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Query:
    """One trajectory's context at one step, tokenised."""

    ids: np.ndarray
    features: np.ndarray


def query(prompt: str, pieces: Sequence[str], step: int, generated: int, context_len: int) -> Query:
    ids = context.encode(qwen_tokenizer(), prompt, pieces)
    return Query(ids, context.features(step, generated, context_len))


def meta_path(onnx_path: Path) -> Path:
    """The metadata (pooling, padding, window, method) written beside an exported model."""
    return onnx_path.with_suffix(".json")


def _combiner(data: dict[str, Any] | None, path: Path) -> Combiner | None:
    """The combiner stored beside the model; one of an older format is left out (logged), so that a model
    trained before it changed still serves, refined by siblings alone until ``loom predictor train`` refits."""
    if data is None:
        return None
    if data.get("format") != FORMAT:
        log.warning(
            "the combiner beside %s is of format %s, this Loom reads %s: serving without it",
            path,
            data.get("format"),
            FORMAT,
        )
        return None
    return Combiner.from_json(data)


class OnnxRegressor:
    def __init__(self, path: Path, threads: int = 2) -> None:
        meta = json.loads(meta_path(path).read_text())
        self.path = path
        self.method = str(meta["method"])
        self.pool = int(meta["pool"])
        self.pad_id = int(meta["pad_id"])
        # Its error at admission on held-out prompts (log sd) and how much of its ranking is real (the slope
        # of true on predicted log totals), where training measured them.
        self.admission_log_sd: float | None = meta.get("admission_log_sd")
        self.admission_slope: float = float(meta.get("admission_slope", 1.0))
        # What the service serves on top of it (``loom.predict.combine``), fitted on held-out prompts.
        self.combiner = _combiner(meta.get("combiner"), path)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def log_remaining(self, ids: np.ndarray, mask: np.ndarray, feats: np.ndarray) -> np.ndarray:
        out = self.session.run(None, {"input_ids": ids, "attention_mask": mask, "features": feats})[0]
        return np.asarray(out, dtype=np.float64)

    def admission_fit(
        self, first_steps: Sequence[Example], workloads: Sequence[str] | None = None
    ) -> tuple[float, float]:
        """Its error at admission (log sd of predicted over actual totals) and the slope of actual on predicted
        log totals, on the first steps of held-out trajectories; (0, 1) with fewer than two. With each
        example's ``workloads`` label, the slope is the mean within workloads, weighted by their examples: a
        job runs one workload, and telling a search question from a coding task is not ranking either."""
        if len(first_steps) < 2:
            return 0.0, 1.0
        predicted, actual = self.remaining(first_steps).tolist(), [e.total for e in first_steps]
        labels = list(workloads) if workloads is not None else [""] * len(actual)
        slopes, sizes = [], []
        for w in sorted(set(labels)):
            idx = [i for i, x in enumerate(labels) if x == w]
            if len(idx) >= 2:
                slopes.append(log_slope([predicted[i] for i in idx], [actual[i] for i in idx]))
                sizes.append(len(idx))
        slope = float(np.average(slopes, weights=sizes)) if slopes else 1.0
        return log_error_sd(predicted, actual), slope

    def remaining(self, queries: Sequence[context.Windowed]) -> np.ndarray:
        """Predicted remaining completion tokens, one per query, in one batch."""
        if not queries:
            return np.zeros(0)
        ids, mask, feats = context.inputs(queries, self.pad_id, self.pool)
        return np.maximum(0.0, np.expm1(self.log_remaining(ids, mask, feats)))

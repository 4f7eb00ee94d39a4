"""Latency of the exported regressor under ONNX Runtime, in a process of its own as the service runs it.

``python -m loom.bench.predictor_latency MODEL WINDOWS.npy REPEATS`` prints one JSON object: p50 and p99 in ms of a
batch of 1 and of all the windows. A process that has trained with torch keeps torch's worker threads
spinning on the same cores, which is not what the service sees, hence the separate process.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from loom.predict import context
from loom.predict.onnx_model import OnnxRegressor, Query


def measure(model: OnnxRegressor, windows: list[np.ndarray], repeats: int) -> dict[str, dict[str, float]]:
    queries = [Query(w, np.zeros(context.N_FEATURES, dtype=np.float32)) for w in windows]
    for _ in range(10):  # warm-up: allocations, thread pools, caches
        model.remaining(queries)
    out = {}
    for name, qs in (("b1", queries[:1]), (f"b{len(queries)}", queries)):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.remaining(qs)
            times.append(time.perf_counter() - t0)
        ms = np.asarray(times) * 1e3
        out[name] = {
            "p50": round(float(np.percentile(ms, 50)), 2),
            "p99": round(float(np.percentile(ms, 99)), 2),
        }
    return out


def main() -> None:
    model_path, windows_path, repeats = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    windows = list(np.load(windows_path))
    print(json.dumps(measure(OnnxRegressor(model_path), windows, repeats)))


if __name__ == "__main__":
    main()

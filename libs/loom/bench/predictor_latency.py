"""Latency of the exported regressor under ONNX Runtime, in a process of its own as the service runs it, and
of what the service serves: the regressor's batch, then the combiner (``loom.predict.combine``) on each of its
queries in turn, as the service's event loop answers a batch's requests. What the combiner reads but the
regressor's answer is prepared beforehand (``combine.prepare``), as the service does while a request waits
for its batch and the batch runs on the regressor's thread.

``python -m loom.bench.predictor_latency MODEL WINDOWS.npy REPEATS [SERVED.json]`` prints one JSON object: p50
and p99 in ms of a batch of 1 and of all the windows (``b1``, ``b32``), and with SERVED.json (a combiner and
what is known of one trajectory per window, ``served_input``) the same for what is served (``served_b1``,
``served_b32``). A process that has trained with torch keeps torch's worker threads spinning on the same cores,
which is not what the service sees, hence the separate process.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loom.predict import context
from loom.predict.combine import Combiner, Known, prepare
from loom.predict.onnx_model import OnnxRegressor, Query


def served_input(combiner: Combiner, known: Sequence[Known]) -> dict[str, Any]:
    """What SERVED.json holds: the combiner, and the trajectories the windows stand for."""
    return {"combiner": combiner.to_json(), "known": [dataclasses.asdict(k) for k in known]}


def _known(d: dict[str, Any]) -> Known:
    return Known(
        **{
            **d,
            "history": tuple(d["history"]),
            "finished": tuple(d["finished"]),
            "running": tuple(tuple(r) for r in d["running"]),
        }
    )


def measure(
    model: OnnxRegressor,
    windows: list[np.ndarray],
    repeats: int,
    served: tuple[Combiner, list[Known]] | None = None,
) -> dict[str, Any]:
    queries = [Query(w, np.zeros(context.N_FEATURES, dtype=np.float32)) for w in windows]
    for _ in range(10):  # warm-up: allocations, thread pools, caches
        model.remaining(queries)

    def text(qs: list[Query]) -> None:
        model.remaining(qs)

    prepared = [prepare(k) for k in served[1]] if served is not None else []

    def combined(qs: list[Query]) -> None:
        assert served is not None
        combiner = served[0]
        # As the service does: a query whose estimate does not read the text model's total is answered
        # without it, and the batch holds the rest.
        read = [(p, q) for p, q in zip(prepared, qs, strict=False) if combiner.total_unread(p) is None]
        if read:
            for (p, _), r in zip(read, model.remaining([q for _, q in read]), strict=True):
                combiner.total_prepared(p, p.known.generated + float(r))

    runs = {"": text} | ({"served_": combined} if served is not None else {})
    out: dict[str, Any] = {}
    if served is not None:
        out["served_text_share"] = round(
            sum(served[0].total_unread(p) is None for p in prepared) / max(1, len(prepared)), 3
        )
    for name, qs in (("b1", queries[:1]), (f"b{len(queries)}", queries)):
        # Interleaved, so that both see the same moments of a busy host.
        times: dict[str, list[float]] = {prefix: [] for prefix in runs}
        for _ in range(repeats):
            for prefix, run in runs.items():
                t0 = time.perf_counter()
                run(qs)
                times[prefix].append(time.perf_counter() - t0)
        for prefix, ts in times.items():
            ms = np.asarray(ts) * 1e3
            out[prefix + name] = {
                # Three places: a query answered without the text model takes microseconds.
                "p50": round(float(np.percentile(ms, 50)), 3),
                "p99": round(float(np.percentile(ms, 99)), 3),
            }
    return out


def main() -> None:
    model_path, windows_path, repeats = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    windows = list(np.load(windows_path))
    served = None
    if len(sys.argv) > 4:
        data = json.loads(Path(sys.argv[4]).read_text())
        served = (Combiner.from_json(data["combiner"]), [_known(k) for k in data["known"]])
    print(json.dumps(measure(OnnxRegressor(model_path), windows, repeats, served)))


if __name__ == "__main__":
    main()

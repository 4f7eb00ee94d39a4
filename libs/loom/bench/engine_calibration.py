"""Published measurements the performance model is calibrated against, the fit of its efficiencies, and
the model's error on every point.

The fit runs offline (and in a test that checks the recorded numbers): ``perf.EFFICIENCY`` and the
``Efficiency`` defaults hold its rounded result, so that building a ``PerfModel`` never refits.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from loom.engine.model import perf
from loom.engine.model.perf import EFFICIENCY, Efficiency, PerfModel

Quantity = Literal["decode_tok_s", "non_attention_ms"]

_QWEN = "Qwen3 speed benchmark: SGLang 0.4.6, BF16, batch 1, 1-token prompt, 2,048 generated tokens"
_VIDUR = "Vidur H100 profile of Llama-2-7B: non-attention time of one iteration"
_GENERATED = 2048


@dataclass(frozen=True)
class Point:
    source: str
    gpu: str
    model: str
    tp: int
    quantity: Quantity
    x: int  # batch size for decode speeds, tokens in the iteration for Vidur's times
    published: float

    def predict(self, perf: PerfModel) -> float:
        if self.quantity == "decode_tok_s":
            return self.x * _GENERATED / perf.decode_span(self.x, self.x, _GENERATED)
        return perf.linear_layers_time(self.x) * 1e3


POINTS: tuple[Point, ...] = (
    Point(_QWEN, "h20", "qwen3-8b", 1, "decode_tok_s", 1, 81.7),
    Point(_QWEN, "h20", "qwen3-14b", 1, "decode_tok_s", 1, 47.1),
    Point(_QWEN, "h20", "qwen3-32b", 1, "decode_tok_s", 1, 20.7),
    *(
        Point(_VIDUR, "h100", "llama-2-7b", 1, "non_attention_ms", tokens, ms)
        for tokens, ms in ((1, 5.6), (128, 6.4), (512, 12.0), (1024, 21.0), (2048, 40.5))
    ),
)


@dataclass(frozen=True)
class Comparison:
    point: Point
    predicted: float

    @property
    def rel_error(self) -> float:
        return self.predicted / self.point.published - 1

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self.point), "predicted": self.predicted, "rel_error": self.rel_error}


def calibration_report(efficiency: dict[str, Efficiency] | None = None) -> list[Comparison]:
    """The model's prediction for every published point, with the recorded efficiencies by default, or with
    a table like ``fit``'s: efficiencies by GPU, and under "default" those of every other GPU."""
    table = EFFICIENCY if efficiency is None else efficiency
    default = table.get("default", Efficiency())
    return [
        Comparison(p, p.predict(PerfModel(p.gpu, p.model, p.tp, table.get(p.gpu, default)))) for p in POINTS
    ]


def fit() -> dict[str, Efficiency]:
    """Least-squares fit, in relative error, of the default efficiencies to Vidur's H100 points (overhead
    excluded: Vidur times kernels alone) and of H20's memory efficiency and overhead to Qwen's speeds."""
    vidur = [p for p in POINTS if p.gpu == "h100"]
    qwen = [p for p in POINTS if p.gpu == "h20"]

    def base_of(x: Sequence[float]) -> Efficiency:
        return replace(Efficiency(), compute=x[0], memory=x[1], exposed=x[2])

    # Neutral starting points, so that a refit does not lean on the recorded numbers it checks.
    base = base_of(
        _minimise(lambda x: _loss(vidur, base_of(x)), [0.5, 0.5, 0.5], [(0.2, 1.0), (0.2, 1.0), (0.0, 1.0)])
    )

    def h20_of(x: Sequence[float]) -> Efficiency:
        return replace(base, memory=x[0], overhead_s=x[1])

    h20 = h20_of(_minimise(lambda x: _loss(qwen, h20_of(x)), [0.5, 0.0005], [(0.05, 1.0), (0.0, 0.01)]))
    return {"default": base, "h20": h20}


def _loss(points: Sequence[Point], eff: Efficiency) -> float:
    return sum((p.predict(PerfModel(p.gpu, p.model, p.tp, eff)) / p.published - 1) ** 2 for p in points)


def _minimise(
    f: Callable[[Sequence[float]], float], x0: Sequence[float], bounds: Sequence[tuple[float, float]]
) -> list[float]:
    """Compass search within bounds: try a step up and down each coordinate, halve the steps when nothing
    improves. Deterministic, and enough for a handful of smooth parameters (scipy is not a dependency)."""
    x = list(x0)
    fx = f(x)
    steps = [(hi - lo) / 4 for lo, hi in bounds]
    while any(s > 1e-7 * (hi - lo) for s, (lo, hi) in zip(steps, bounds, strict=True)):
        improved = False
        for i, (lo, hi) in enumerate(bounds):
            for sign in (1, -1):
                y = list(x)
                y[i] = min(hi, max(lo, x[i] + sign * steps[i]))
                fy = f(y)
                if fy < fx:
                    x, fx, improved = y, fy, True
                    break
        if not improved:
            steps = [s / 2 for s in steps]
    return x


# Iteration times measured on one GPU of each kind by ``loom.bench.iteration_profile`` (how: measured/README.md).
# The tables live beside the performance model they calibrate.
MEASURED = {gpu: Path(perf.__file__).parent / "measured" / f"{gpu}_qwen3.json" for gpu in ("h100", "h200")}
# 0.6B is left out of the fits: its unfused iteration launches ~700 kernels, about 3 ms that the model's
# own weights (1.2 GB, 0.3 ms of memory time) do not explain; an engine's fused kernels do not pay it.
MEASURED_MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")


@dataclass(frozen=True)
class Measured:
    model: str
    prefill_tokens: int
    batch: int
    context: int
    seconds: float

    def predict(self, perf: PerfModel) -> float:
        return perf.iteration_time(self.prefill_tokens, self.batch, self.batch * self.context)


def measured_points(gpu: str) -> list[Measured]:
    """The decode and prefill iterations measured on one ``gpu``."""
    table = json.loads(MEASURED[gpu].read_text())
    points = []
    for m in table["models"]:
        points += [Measured(m["model"], 0, d["batch"], d["context"], d["seconds"]) for d in m["decode"]]
        points += [Measured(m["model"], p["tokens"], 0, 0, p["seconds"]) for p in m["prefill"]]
    return points


def interference_errors(gpu: str) -> dict[str, list[float]]:
    """For each measured model, the relative error of the recorded model's interference factor (Heddle's F:
    a batch's per-token time over batch 1's at the same context) at every measured batch above 1."""
    points = measured_points(gpu)
    out: dict[str, list[float]] = {}
    for name in sorted({p.model for p in points}):
        perf = PerfModel(gpu, name)
        decode = [p for p in points if p.model == name and not p.prefill_tokens]
        base = {p.context: p.seconds for p in decode if p.batch == 1}
        out[name] = [
            perf.interference(p.batch, p.context) / (p.seconds / base[p.context]) - 1
            for p in decode
            if p.batch > 1 and p.context in base
        ]
    return out


def fit_measured(gpu: str, models: Sequence[str] = MEASURED_MODELS) -> tuple[Efficiency, list[float]]:
    """The efficiencies and overhead that best explain a measured table's iteration times (least squares of
    relative error), and each point's relative error under them: how far the roofline's form is from a
    real GPU, apart from how fast the measured implementation is."""
    points = measured_points(gpu)
    chosen = [p for p in points if p.model in models]

    def of(x: Sequence[float]) -> Efficiency:
        return replace(Efficiency(), compute=x[0], memory=x[1], exposed=x[2], overhead_s=x[3])

    def errors(eff: Efficiency) -> list[float]:
        return [p.predict(PerfModel(gpu, p.model, 1, eff)) / p.seconds - 1 for p in chosen]

    x = _minimise(
        lambda x: sum(e * e for e in errors(of(x))),
        [0.5, 0.5, 0.5, 0.001],
        [(0.1, 1.0), (0.1, 1.0), (0.0, 1.0), (0.0, 0.01)],
    )
    return of(x), errors(of(x))

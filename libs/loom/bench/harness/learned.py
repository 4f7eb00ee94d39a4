"""Loom's learned length predictor in the harness, cross-fitted by prompt.

The prompts of all three trace sets (coding, search, tool use) are dealt into ``folds`` folds; fold f's model
is the progressive regressor trained (``loom.predict.train``, as ``loom predictor train`` does) on the
trajectories of every other fold and exported to ONNX, so every trajectory is predicted by a model that never
saw its prompt. Each prediction is served as the predictor service serves it: the context the service would
be sent after k calls (the prompt, the actions and observations so far, the step features), windowed and run
by ONNX Runtime; the total is the tokens generated so far plus the predicted remainder.

A sample that varies its recorded run (``WorkTraj.origin``) is read as the service would see it: its own
sequence of recorded actions and observations, its own step count, tokens and context length.

Models and predictions are cached under ``$LOOM_HOME/cache/learned``, keyed by everything they depend on
(the trace files, the code that reads and trains, the budget, the folds, the seed and, for predictions, the
workload's trajectories), so a benchmark pays for training once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loom.data import trace_sets
from loom.data.traces import Trace, prompt_of
from loom.predict.onnx_model import meta_path
from loom.workloads.base import Workload, WorkTraj

FOLDS = 5
# Optimiser steps per fold model: what a minute of training reached on an idle two-core machine, counted so
# that every machine trains the same models (``loom.predict.train``).
STEPS_PER_FOLD = 200
# Share of each fold's training prompts held out to choose its epoch and its gates.
VAL_SHARE = 0.125
BATCH = 256


def fold_of(prompt: str, folds: int, seed: int = 0) -> int:
    return zlib.crc32(f"fold:{seed}:{prompt}".encode()) % folds


def cache_root() -> Path:
    return Path(os.environ.get("LOOM_HOME", ".loom")) / "cache" / "learned"


# Bumped when this module changes how folds are trained (MODEL) or how a trajectory is queried (QUERY): the
# library code both depend on is hashed into the cache keys by itself.
MODEL_VERSION = 3
QUERY_VERSION = 1


def _code_version() -> str:
    """The source of the library code a model depends on: a change to any of it is a different model."""
    import loom.data.traces as traces
    import loom.predict as predict

    files = [Path(trace_sets.__file__), Path(traces.__file__)]
    pkg = Path(predict.__file__).parent
    files += [pkg / f"{m}.py" for m in ("context", "dataset", "regressor", "train", "export", "onnx_model")]
    h = hashlib.sha1(str(MODEL_VERSION).encode())
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class Budget:
    steps_per_fold: int = STEPS_PER_FOLD
    folds: int = FOLDS
    seed: int = 0
    # A trace set none of the models saw: one model, trained on the others, predicts every trajectory (a test
    # on a workload the predictor was not trained on). Empty: cross-fitted by prompt.
    held_out: str = ""

    def __post_init__(self) -> None:
        if self.held_out and self.folds != 1:
            raise ValueError("a held-out trace set is predicted by one model: folds must be 1")

    def key(self) -> str:
        h = hashlib.sha1(_code_version().encode())
        for name in trace_sets.SETS:
            for t in trace_sets.trace_set(name):
                h.update(f"{t.id}:{len(t.steps)}:{t.total_completion_tokens};".encode())
        h.update(f"{self.steps_per_fold}:{self.folds}:{self.seed}".encode())
        if self.held_out:
            h.update(f":held_out={self.held_out}".encode())
        return h.hexdigest()[:16]


def _all_traces() -> dict[str, Trace]:
    return {t.id: t for name in trace_sets.SETS for t in trace_sets.trace_set(name)}


@functools.lru_cache(maxsize=1)
def _examples() -> tuple[Any, ...]:
    """Every prediction point of the three trace sets, tokenised (about 30 s on two cores): read once per
    process, however many models it trains (a benchmark's folds, then its held-out models)."""
    from loom.predict import dataset

    out: list[Any] = []
    for t in _all_traces().values():
        out.extend(dataset.trajectory_examples(t, cache={}))
    return tuple(out)


def _calibrated(path: Path) -> bool:
    """An exported fold model whose error at admission was measured (the last step of training one)."""
    meta = meta_path(path)
    return meta.exists() and "admission_slope" in json.loads(meta.read_text())


def train_folds(budget: Budget, root: Path, log: Callable[[str], None] | None = None) -> list[Path]:
    """One exported model per fold, cached in ``root``: each trained on the prompts outside its fold."""
    from loom.predict import train
    from loom.predict.export import calibrate, export

    paths = [root / f"fold{f}" / "model.onnx" for f in range(budget.folds)]
    if all(_calibrated(p) for p in paths):
        return paths
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    todo = sum(not _calibrated(p) for p in paths)
    # A fold trains its steps (about 0.6 s each on two cores), then is exported and calibrated (about 10 s
    # more); reading the traces into examples takes about 30 s. Said up front: a first run is otherwise
    # minutes of silence.
    eta_s = 30 + todo * (0.6 * budget.steps_per_fold + 10)
    say(
        f"learned predictor: training {todo} of {budget.folds} fold models ({budget.steps_per_fold} steps "
        f"each), about {eta_s / 60:.1f} min; once: cached in {root} for later runs"
    )
    workload_of = trace_sets.workload_of_prompts()
    examples = _examples()
    folds_started, trained = time.monotonic(), 0
    for f, path in enumerate(paths):
        if _calibrated(path):
            continue
        t0 = time.monotonic()
        if budget.held_out:  # one model (fold_of is 0 for every prompt): the other trace sets
            rest = [e for e in examples if workload_of[e.task_id] != budget.held_out]
        else:
            rest = [e for e in examples if fold_of(e.task_id, budget.folds, budget.seed) != f]
        is_val = [zlib.crc32(f"val:{e.task_id}".encode()) / 2**32 < VAL_SHARE for e in rest]
        train_set = [e for e, v in zip(rest, is_val, strict=True) if not v]
        val_set = [e for e, v in zip(rest, is_val, strict=True) if v]
        cfg = train.TrainConfig(max_steps=budget.steps_per_fold, seed=budget.seed)
        report = train.train(train_set, val_set, cfg, path.parent)
        export(path.parent, path, "progressive")
        first = [e for e in val_set if e.step == 0]
        sd, slope = calibrate(path, first, [workload_of[e.task_id] for e in first])
        say(
            f"learned predictor fold {f + 1}/{budget.folds}: {len(train_set)} examples, best epoch "
            f"{report.best_epoch}, val loss {report.val_loss:.3f}, error at admission {sd:.2f} (log sd), "
            f"slope {slope:.2f}, {time.monotonic() - t0:.0f} s"
        )
        trained += 1
        if todo > trained:
            per_fold = (time.monotonic() - folds_started) / trained
            say(
                f"learned predictor: {todo - trained} fold(s) to go, about {(todo - trained) * per_fold / 60:.1f} min"
            )
    return paths


def _queries(
    t: WorkTraj, trace: Trace, cache: dict[str, list[int]], steps: Sequence[int] | None = None
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """What the service is sent at each of the trajectory's prediction points (0 to n - 1 calls done, or
    those of ``steps`` it reaches): its own sequence of recorded actions and observations, with its own
    calls."""
    from loom.predict.dataset import prediction_points

    origin = t.origin or tuple(range(len(t.steps)))
    actions = [trace.steps[i].action for i in origin]
    observations = [trace.steps[i].observation for i in origin]
    points = prediction_points(trace.task, actions, observations, t.calls, steps, cache=cache)
    return [(k, ids, features) for k, _, ids, features in points]


@dataclass(frozen=True)
class Learned:
    """The predictions a harness run reads: each trajectory's predicted total after 0 .. n - 1 calls, and
    the models' error at admission on held-out prompts (the resolution placement can trust them to)."""

    totals: dict[str, np.ndarray]
    admission_log_sd: float
    admission_slope: float = 1.0  # how much of a difference between two of them is real
    # What the predictor serves on top of the text model (``loom.bench.harness.served``): a combiner per
    # fold, each trajectory served by its prompt's combiner fold's (``combiner_fold``, else the prompt's own
    # fold). Empty: the text model alone.
    combiners: tuple[Any, ...] = ()
    folds: int = FOLDS
    seed: int = 0
    combiner_fold: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def combiner(self, prompt: str) -> Any:
        """The combiner that never saw ``prompt`` (a prompt key)."""
        fold = self.combiner_fold.get(prompt)
        return self.combiners[fold_of(prompt, self.folds, self.seed) if fold is None else fold]


@dataclass(frozen=True)
class _Query:
    ids: np.ndarray
    features: np.ndarray


def _workload_key(
    w: Workload, steps: Sequence[int] | None = None, traces: Mapping[str, Trace] | None = None
) -> str:
    h = hashlib.sha1(f"{QUERY_VERSION}{'' if steps is None else sorted(steps)}".encode())
    for t in w.trajectories:
        h.update(f"{t.id}|{t.trace}|{t.origin}|{t.calls};".encode())
        if traces is not None:  # a file's text: its ids alone do not name it, as a trace set's do
            trace = traces[t.trace]
            h.update(repr((trace.task, [(s.action, s.observation) for s in trace.steps])).encode())
    return h.hexdigest()[:16]


def cross_fitted(
    workload: Workload,
    budget: Budget | None = None,
    log: Callable[[str], None] | None = None,
    steps: Sequence[int] | None = None,
    traces: Mapping[str, Trace] | None = None,
) -> Learned:
    """Each trajectory's predicted total length after 0, 1, ..., n - 1 calls, by the model of its fold; with
    ``steps``, only after those (the others are NaN): a fraction of the queries, for an evaluation. Its
    recorded runs are the trace sets', or ``traces`` (a rollout-trace file's, ``Recorded.traces``)."""
    budget = budget or Budget()
    known = traces if traces is not None else _all_traces()
    missing = [t.id for t in workload.trajectories if t.trace not in known]
    if missing:
        raise ValueError(f"{len(missing)} trajectories name no recorded trace (e.g. {missing[0]!r})")
    root = cache_root() / budget.key()
    paths = train_folds(budget, root, log)
    metas = [json.loads(meta_path(p).read_text()) for p in paths]
    sd = float(np.mean([m["admission_log_sd"] for m in metas]))
    slope = float(np.mean([m.get("admission_slope", 1.0) for m in metas]))
    return Learned(_predict(workload, budget, root, paths, steps, traces), sd, slope)


def _predict(
    workload: Workload,
    budget: Budget,
    root: Path,
    paths: Sequence[Path],
    steps: Sequence[int] | None = None,
    traces: Mapping[str, Trace] | None = None,
) -> dict[str, np.ndarray]:
    from loom.predict.onnx_model import OnnxRegressor

    path = root / f"predictions-{_workload_key(workload, steps, traces)}.npz"
    if path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    models = [OnnxRegressor(p) for p in paths]
    out = totals_by(
        workload, lambda trace: models[fold_of(prompt_of(trace), budget.folds, budget.seed)], steps, traces
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **out)  # type: ignore[arg-type]
    tmp.replace(path)
    return out


def totals_by(
    workload: Workload,
    model_of: Callable[[Trace], Any],
    steps: Sequence[int] | None = None,
    traces: Mapping[str, Trace] | None = None,
) -> dict[str, np.ndarray]:
    """Each trajectory's predicted total after 0 .. n - 1 calls (or at ``steps``, NaN elsewhere) by the
    exported model ``model_of`` its recorded trace (an ``OnnxRegressor``), in batches per model; the
    recorded runs the trace sets' unless ``traces`` are given."""
    if traces is None:
        traces = _all_traces()
    by_model: dict[int, tuple[Any, list[tuple[str, int, _Query]]]] = {}
    cache: dict[str, list[int]] = {}
    for t in workload.trajectories:
        trace = traces[t.trace]
        model = model_of(trace)
        items = by_model.setdefault(id(model), (model, []))[1]
        for k, ids, feats in _queries(t, trace, cache, steps):
            items.append((t.id, k, _Query(ids, feats)))
    fill = 0.0 if steps is None else np.nan
    out = {t.id: np.full(len(t.steps), fill, dtype=np.float64) for t in workload.trajectories}
    for model, items in by_model.values():
        for i in range(0, len(items), BATCH):
            chunk = items[i : i + BATCH]
            remaining = model.remaining([q for _, _, q in chunk])
            for (tid, k, _), r in zip(chunk, remaining, strict=True):
                out[tid][k] = r
    for t in workload.trajectories:
        out[t.id] += np.cumsum([0, *(s.output_len for s in t.steps[:-1])])
    return out

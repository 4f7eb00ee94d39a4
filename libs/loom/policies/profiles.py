"""Worker profiles for placement, from the engine performance model (Heddle §5.2, "Interference Factor").

F(g) is the slowdown of a group of g trajectories sharing one worker. A trajectory generates only part of
the time (the rest is tool calls), so g trajectories keep about g * duty sequences decoding; per-token
time follows the engine model's batch curve up to the engine's batch limit (its ``max_running``, or as many
contexts as its KV cache holds), and past it the extra trajectories queue, stretching time in proportion. F is normalised to F(1) = 1 and kept nondecreasing.
"""

from __future__ import annotations

import numpy as np

from loom.engine.interference import interference_table
from loom.engine.perf import PerfModel
from loom.policies.partition import WorkerProfile


def group_interference(
    batch_factors: tuple[float, ...], max_group: int, duty: float, max_running: int
) -> np.ndarray:
    if not 0 < duty <= 1:
        raise ValueError(f"duty must be in (0, 1], got {duty}")
    g = np.arange(max_group + 1, dtype=np.float64)
    active = np.maximum(g * duty, 1.0)
    batch = np.minimum(np.rint(active), min(max_running, len(batch_factors))).astype(np.int64)
    f = np.asarray(batch_factors)[batch - 1]
    f = f * np.maximum(active / max_running, 1.0)
    f = np.maximum.accumulate(f / f[1] if max_group >= 1 else f)
    f[0] = 0.0
    return f


def worker_profile(
    model: str, gpu: str, tp: int, *, context_len: int, max_running: int, duty: float, max_group: int
) -> WorkerProfile:
    table = interference_table(model, gpu, tp, context_len)
    fits = PerfModel(gpu, model, tp).kv_capacity_tokens() // max(1, context_len)
    limit = max(1, min(max_running, fits))
    return WorkerProfile(table.base_s, group_interference(table.factors, max_group, duty, limit))


def generation_duty(step_tokens: float, per_token_s: float, tool_s: float) -> float:
    """Share of a trajectory's time spent generating, for one step of ``step_tokens`` then a tool call."""
    gen = step_tokens * per_token_s
    return gen / (gen + tool_s) if gen + tool_s > 0 else 1.0


# Output tokens of a typical agent step (SWE traces: about 270): sets the share of time spent generating.
STEP_TOKENS = 300.0


def placement_profile(
    model: str, gpu: str, tp: int, *, context_len: int, max_running: int, tool_s: float, max_group: int
) -> WorkerProfile:
    """A worker's profile for a job whose steps are followed by tool calls of ``tool_s`` on average."""
    base = worker_profile(
        model, gpu, tp, context_len=context_len, max_running=max_running, duty=1.0, max_group=1
    )
    duty = generation_duty(STEP_TOKENS, base.per_token_s, tool_s)
    return worker_profile(
        model, gpu, tp, context_len=context_len, max_running=max_running, duty=duty, max_group=max_group
    )

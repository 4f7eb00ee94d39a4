"""Interference tables for placement: Heddle's F(group size) and base per-token time T of one engine kind.

Placement evaluates F for every candidate group, so the tables are computed once per model, GPU, TP and
context bucket (the next power of two of the context length) and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from loom.engine.model.perf import PerfModel

MAX_BATCH = 256


@dataclass(frozen=True)
class InterferenceTable:
    base_s: float  # T: per-token time at batch 1
    factors: tuple[float, ...]  # F(b) at index b - 1; F(1) = 1, non-decreasing

    def factor(self, batch: int) -> float:
        if not 1 <= batch <= len(self.factors):
            raise ValueError(f"batch {batch} outside the table's 1..{len(self.factors)}")
        return self.factors[batch - 1]


def context_bucket(context_len: int) -> int:
    return 1 << max(0, context_len - 1).bit_length()


def interference_table(
    model: str, gpu: str, tp: int, context_len: int, max_batch: int = MAX_BATCH
) -> InterferenceTable:
    """F(b) and T for b = 1..``max_batch`` sequences that each hold ``context_len`` tokens (bucketed)."""
    return _table(model.lower(), gpu.lower(), tp, context_bucket(context_len), max_batch)


@lru_cache(maxsize=1024)
def _table(model: str, gpu: str, tp: int, context_len: int, max_batch: int) -> InterferenceTable:
    perf = PerfModel(gpu, model, tp)
    times = [perf.per_token_time(b, context_len) for b in range(1, max_batch + 1)]
    return InterferenceTable(times[0], tuple(t / times[0] for t in times))

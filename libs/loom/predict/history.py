"""History-based length predictor: statistics of finished trajectories of the same prompt, else globally.

It is the fallback when no learned model is loaded, and a baseline of the Heddle paper's prediction study.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class _Stats:
    n: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x

    @property
    def mean(self) -> float:
        return self.total / self.n


@dataclass
class HistoryPredictor:
    # Prior before anything has finished: the median SWE trajectory's output (data/README.md, 9.6k).
    prior_total: float = 9600.0
    by_task: dict[str, _Stats] = field(default_factory=lambda: defaultdict(_Stats))
    overall: _Stats = field(default_factory=_Stats)

    def observe(self, task_id: str, total_tokens: float) -> None:
        self.by_task[task_id].add(total_tokens)
        self.overall.add(total_tokens)

    def predict_total(self, task_id: str, generated: float) -> float:
        st = self.by_task.get(task_id)
        if st is not None and st.n:
            est = st.mean
        elif self.overall.n:
            est = self.overall.mean
        else:
            est = self.prior_total
        # Once a trajectory outlives its estimate, expect it to run about as long again (heavy tail).
        return est if generated < est else 2.0 * generated

    def predict_remaining(self, task_id: str, generated: float) -> float:
        return max(0.0, self.predict_total(task_id, generated) - generated)

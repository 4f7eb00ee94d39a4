"""The learned model's estimate refined by the finished samples of the same prompt.

The model reads one trajectory's context; it cannot know how the other samples of its GRPO group went, and
those say a lot: on the multi-trial traces a prompt's samples spread about their own mean with a log
standard deviation of 0.46 (tau-bench), against 0.55 between prompts. Once samples of a prompt finish, the
estimate is the precision-weighted mean, in log space, of the model's total and the finished samples' mean:

    log T = (w_m log T_model + w_s mean_s) / (w_m + w_s),  w_m = 1 / sd_model^2,  w_s = 1 / (sd_within^2 (1 + 1/n))

(a new sample deviates from its prompt's mean by sd_within, and n samples know that mean to sd_within^2 / n).
Neither spread is assumed: both are measured online from finished trajectories (the model's error at
admission, the pooled spread within prompts), starting from priors worth ``PRIOR_DOF`` observations: the
model's error on held-out prompts, and tau-bench's within-prompt spread. The estimate is never below what the
trajectory has generated.

The predictor service serves it and the harness replays it: one implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# tau-bench airline, 4 trials of 40 tasks: the within-prompt log sd of total output (``workloads.siblings``).
WITHIN_PRIOR = 0.458
PRIOR_DOF = 10.0


@dataclass
class _Spread:
    """A log standard deviation: a prior worth ``PRIOR_DOF`` observations, then squared deviations."""

    prior: float
    ss: float = 0.0
    dof: float = 0.0

    def add(self, squared: float) -> None:
        self.ss += squared
        self.dof += 1

    @property
    def sd(self) -> float:
        return math.sqrt((self.prior**2 * PRIOR_DOF + self.ss) / (PRIOR_DOF + self.dof))


@dataclass
class _Prompt:
    n: int = 0
    mean: float = 0.0  # of log totals


class SiblingBlend:
    def __init__(self, model_log_sd: float, within_log_sd: float = WITHIN_PRIOR) -> None:
        if model_log_sd <= 0 or within_log_sd <= 0:
            raise ValueError("spreads must be positive")
        self.model = _Spread(model_log_sd)
        self.within = _Spread(within_log_sd)
        self.prompts: dict[str, _Prompt] = {}

    def observe(self, prompt: str, total: float, admitted: float | None = None) -> None:
        """A finished trajectory: its prompt, its total length and, if known, the model's total for it at
        admission (its error measures the model)."""
        x = math.log(max(total, 1.0))
        if admitted is not None:
            self.model.add((x - math.log(max(admitted, 1.0))) ** 2)
        p = self.prompts.setdefault(prompt, _Prompt())
        p.n += 1
        delta = x - p.mean
        p.mean += delta / p.n
        if (
            p.n > 1
        ):  # Welford: each sample after a prompt's first adds a degree of freedom to the pooled spread
            self.within.add(delta * (x - p.mean))

    def total(self, prompt: str, model_total: float, generated: float) -> float:
        p = self.prompts.get(prompt)
        if p is None or not p.n:
            return max(model_total, generated)
        w_model = 1.0 / self.model.sd**2
        w_siblings = 1.0 / (self.within.sd**2 * (1.0 + 1.0 / p.n))
        log_t = (w_model * math.log(max(model_total, 1.0)) + w_siblings * p.mean) / (w_model + w_siblings)
        return max(math.exp(log_t), generated)

    def spreads(self) -> dict[str, float]:
        return {"model_log_sd": round(self.model.sd, 3), "within_log_sd": round(self.within.sd, 3)}

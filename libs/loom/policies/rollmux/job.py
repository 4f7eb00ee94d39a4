"""An RL post-training job as the co-scheduler sees it: worst-case phase times, nodes, footprint, SLO.

Phase times are upper bounds: the profile assumes every response reaches the job's maximum length (paper
§4.2, conservative planning), so a plan that meets the SLO with them meets it at run time. Memory per node
is the paper's Table 2 (GB of host DRAM to keep a rollout or training actor resident on an 8-GPU node);
warm-start latency per phase is its Figure 4.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Table 2: host memory (GB) to cache a rollout / training actor on one 8-GPU node.
ROLL_MEM_GB = {"3b": 113.4, "7b": 275.7, "14b": 445.4, "32b": 490.3}
TRAIN_MEM_GB = {"3b": 156.2, "7b": 240.0, "14b": 456.1, "32b": 520.4}
# Figure 4: warm-start latency (s) of a rollout / training phase from host DRAM on one 8-GPU node.
ROLL_WARM_S = {"3b": 0.8, "7b": 0.9, "14b": 1.8, "32b": 1.7}
TRAIN_WARM_S = {"3b": 1.9, "7b": 4.1, "14b": 4.7, "32b": 5.9}
MODELS = tuple(ROLL_MEM_GB)


@dataclass(frozen=True)
class RLJob:
    id: str
    model: str
    t_roll: float  # worst-case rollout phase (s) on its own roll_nodes
    t_train: float  # worst-case training phase (s) on its own train_nodes
    slo: float = 1.5  # tolerated slowdown of an iteration against running solo
    roll_nodes: int = 1
    train_nodes: int = 1

    def __post_init__(self) -> None:
        if self.model not in ROLL_MEM_GB:
            raise ValueError(f"unknown model size {self.model!r}; known: {', '.join(MODELS)}")
        if self.t_roll <= 0 or self.t_train <= 0:
            raise ValueError("phase times must be positive")
        if self.slo < 1.0:
            raise ValueError("an SLO is a tolerated slowdown, at least 1.0")
        if self.roll_nodes < 1 or self.train_nodes < 1:
            raise ValueError("a job needs at least one rollout and one training node")

    @property
    def t_solo(self) -> float:
        return self.t_roll + self.t_train

    @property
    def budget(self) -> float:
        """The longest iteration the SLO allows."""
        return self.slo * self.t_solo

    @property
    def roll_mem(self) -> float:
        return ROLL_MEM_GB[self.model]

    @property
    def train_mem(self) -> float:
        return TRAIN_MEM_GB[self.model]

    @property
    def roll_warm(self) -> float:
        return ROLL_WARM_S[self.model]

    @property
    def train_warm(self) -> float:
        return TRAIN_WARM_S[self.model]


# Paper Table 6: (rollout, train) phase times drawn from uniform ranges (s), per workload and size.
PROFILES: dict[str, dict[str, tuple[tuple[float, float], tuple[float, float]]]] = {
    "balanced": {
        "small": ((50, 100), (50, 100)),
        "medium": ((100, 200), (100, 200)),
        "large": ((200, 300), (200, 300)),
    },
    "rollout_heavy": {
        "small": ((100, 200), (25, 50)),
        "medium": ((200, 400), (50, 100)),
        "large": ((400, 600), (100, 200)),
    },
    "train_heavy": {
        "small": ((25, 50), (100, 200)),
        "medium": ((50, 100), (200, 400)),
        "large": ((100, 200), (400, 600)),
    },
}
WORKLOADS = (*PROFILES, "mixed")
# Sizes map to the paper's testbed jobs (Table 3): 7B and 14B on 8 + 8 GPUs, 32B on 16 + 16.
SIZE_MODEL = {"small": ("7b", 1), "medium": ("14b", 1), "large": ("32b", 2)}


def sample_job(
    job_id: str, workload: str, rng: random.Random, slo: float | tuple[float, float] = (1.0, 2.0)
) -> RLJob:
    """One job of a Table 6 workload ("mixed" draws uniformly from all nine configurations)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    profile = rng.choice(tuple(PROFILES)) if workload == "mixed" else workload
    size = rng.choice(tuple(SIZE_MODEL))
    (r0, r1), (t0, t1) = PROFILES[profile][size]
    model, nodes = SIZE_MODEL[size]
    s = rng.uniform(*slo) if isinstance(slo, tuple) else slo
    return RLJob(job_id, model, rng.uniform(r0, r1), rng.uniform(t0, t1), max(1.0, s), nodes, nodes)

"""The training stage of an RL step, priced: a GRPO update's time from the tokens it trains, and the time to
move the new weights to the rollout engines.

Update time is FLOPs over achieved throughput. Each trained trajectory is one sequence of its final context;
a forward pass costs ``2 x`` the dense parameters and the LM head per token plus causal attention
(``2 x 2 x layers x heads x head_dim x c^2 / 2`` for a sequence of ``c`` tokens), and an update takes
``PASSES`` of them: forward and backward (3) and the forward that recomputes the old policy's log-probs (1),
as verl and ROLL run GRPO without a reference model. The achieved fraction of the GPUs' dense BF16 peak
(MFU) is the one published figure for agentic RL training: RollArt §3.1, Figure 3, a Qwen3-8B SWE-bench
job, batch 128, 32 H800: training is 23% of a 365.7 s iteration (84.1 s). Replaying 128 of the SWE-bench
Verified trajectories Loom's coding workload holds (capped at RollArt's 32K context) through this formula
gives ``MFU``; a test recomputes it from the trace. It is low against pretraining's 40-50%, as RL training
on variable-length sequences with recomputation is.

Weight synchronisation is RollArt Table 3 (Mooncake store; Qwen3 weights in BF16, sizes in GiB): over TCP
(200 Gbps Ethernet, across clusters) and RDMA (400 Gbps InfiniBand, within one), interpolated linearly in
the weights' size between the measured models, in proportion below the smallest and along the last segment
beyond the largest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from loom.engine.model.perf import GpuSpec, ModelConfig, gpu_spec, model_config

PASSES = 4
# RollArt Figure 3: 23% of 365.7 s.
FIG3_TRAIN_S = 0.23 * 365.7
# Fitted by ``calibrate_mfu`` on the coding workload's first 128 recorded runs (see the module docstring).
MFU = 0.093
# RollArt Table 3: (GiB of weights, TCP s, RDMA s) for Qwen3-8B, 14B and 32B.
TABLE3 = ((15.26, 6.911, 5.466), (27.51, 14.437, 5.817), (61.02, 29.649, 9.442))
LINKS = ("tcp", "rdma")


def sequence_flops(model: ModelConfig, tokens: int) -> float:
    """FLOPs of one forward pass over a sequence of ``tokens`` (causal attention: each token attends to the
    ones before it)."""
    dense = 2.0 * model.layers * (model.attn_params + model.mlp_params) * tokens
    head = 2.0 * model.embedding_params * tokens
    attention = 2.0 * model.layers * model.heads * model.head_dim * tokens * tokens
    return dense + head + attention


def update_flops(model: ModelConfig, sequences: Iterable[int], passes: int = PASSES) -> float:
    return passes * sum(sequence_flops(model, c) for c in sequences)


@dataclass(frozen=True)
class TrainStage:
    """A training cluster: ``gpus`` of ``gpu`` updating ``model`` at ``mfu`` of their peak."""

    model: str = "qwen3-8b"
    gpu: str = "h800"
    gpus: int = 32
    mfu: float = MFU

    def __post_init__(self) -> None:
        if self.gpus < 1 or not 0 < self.mfu <= 1:
            raise ValueError(f"a training stage needs at least one GPU and an MFU in (0, 1], got {self}")
        model_config(self.model), gpu_spec(self.gpu)  # unknown names fail here, not mid-run

    @property
    def spec(self) -> GpuSpec:
        return gpu_spec(self.gpu)

    def step_s(self, sequences: Iterable[int]) -> float:
        """Seconds of one update over trajectories of these final context lengths."""
        rate = self.gpus * self.spec.bf16_tflops * 1e12 * self.mfu
        return update_flops(model_config(self.model), sequences) / rate


def weight_sync_s(model: str | ModelConfig, link: str) -> float:
    """Seconds to move ``model``'s BF16 weights to the rollout engines over ``link`` (Table 3)."""
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; one of {LINKS}")
    m = model_config(model) if isinstance(model, str) else model
    gib = m.weight_bytes / 2**30
    # Through the origin below the smallest model, linear between the measured ones, and along the last
    # segment beyond the largest (np.interp would clamp there).
    sizes = np.array([0.0, *(row[0] for row in TABLE3)])
    times = np.array([0.0, *(row[1 + LINKS.index(link)] for row in TABLE3)])
    i = int(np.clip(np.searchsorted(sizes, gib) - 1, 0, len(sizes) - 2))
    slope = (times[i + 1] - times[i]) / (sizes[i + 1] - sizes[i])
    return float(times[i] + slope * (gib - sizes[i]))


def calibrate_mfu(
    sequences: Iterable[int], gpus: int = 32, gpu: str = "h800", model: str = "qwen3-8b"
) -> float:
    """The MFU at which updating on ``sequences`` takes Figure 3's 84.1 s."""
    flops = update_flops(model_config(model), sequences)
    return flops / (gpus * gpu_spec(gpu).bf16_tflops * 1e12 * FIG3_TRAIN_S)

"""The disaggregated cluster RollMux schedules: a rollout pool and a training pool of 8-GPU nodes.

Prices are the RollMux paper's Table 1 (H20 1.85 $/h, H800 5.28 $/h per GPU). A node's host memory holds the
resident state of every job pinned to it, so that switching phases is a warm start from DRAM (paper §3.2:
1-2 TB nodes hold two to five jobs); the default is 2 TB.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuType:
    name: str
    price_per_hour: float


H20 = GpuType("H20", 1.85)
H800 = GpuType("H800", 5.28)


@dataclass(frozen=True)
class ClusterSpec:
    roll_gpu: GpuType = H20
    train_gpu: GpuType = H800
    gpus_per_node: int = 8
    roll_node_mem_gb: float = 2048.0
    train_node_mem_gb: float = 2048.0
    max_group_size: int = 5
    # Add the warm-start latency of paper Figure 4 to every phase of a job that shares its pools. Off, the
    # model is the paper's ideal of free switches (Theorem 1).
    warm_start: bool = True

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.max_group_size < 1:
            raise ValueError("gpus_per_node and max_group_size must be at least 1")
        if self.roll_node_mem_gb <= 0 or self.train_node_mem_gb <= 0:
            raise ValueError("node host memory must be positive")

    def roll_node_cost(self) -> float:
        return self.gpus_per_node * self.roll_gpu.price_per_hour

    def train_node_cost(self) -> float:
        return self.gpus_per_node * self.train_gpu.price_per_hour

    def cost(self, roll_nodes: int, train_nodes: int) -> float:
        """Provisioning cost in $/h of a pool pair."""
        return roll_nodes * self.roll_node_cost() + train_nodes * self.train_node_cost()

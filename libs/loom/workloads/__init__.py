"""Workloads built from the recorded traces in ../shared/data/traces, for replay and the benchmark harness."""

import functools

from loom.workloads.base import Workload, WorkStep, WorkTraj
from loom.workloads.coding import coding
from loom.workloads.search import search
from loom.workloads.tooluse import tool_use

WORKLOADS = {"coding": coding, "search": search, "tool_use": tool_use}


@functools.cache
def planned_env_s(name: str, group_size: int, seed: int, path: str | None = None) -> float:
    """The tool seconds per call a cluster plans built-in workload ``name`` with: its mean environment time
    per call over its whole task set (``Workload.mean_env_s``), whichever batch of it a run takes, as a
    rollout-trace file's is over the whole file (tool use's simulated-user replies differ from task to task:
    its first 6 of 40 tasks average 0.38 s, all of them 0.47 s)."""
    return WORKLOADS[name](group_size=group_size, seed=seed, path=path).mean_env_s()


__all__ = ["WORKLOADS", "WorkStep", "WorkTraj", "Workload", "coding", "planned_env_s", "search", "tool_use"]

"""Workloads built from the recorded traces in ../shared/data/traces, for replay and the benchmark harness."""

from loom.workloads.base import Workload, WorkStep, WorkTraj
from loom.workloads.coding import coding
from loom.workloads.search import search
from loom.workloads.tooluse import tool_use

WORKLOADS = {"coding": coding, "search": search, "tool_use": tool_use}

__all__ = ["WORKLOADS", "WorkStep", "WorkTraj", "Workload", "coding", "search", "tool_use"]

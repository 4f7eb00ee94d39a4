"""What a benchmark ran on, and its figures over repeated runs: so that a figure can be trusted, told from
the machine's, and a regression seen (a control-plane figure halves on a machine with half the cores)."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def machine(**more: Any) -> dict[str, Any]:
    """The machine as a figure depends on it: CPU model and the cores this process may use, memory, the load
    when the run began (another job's cores are not the benchmark's), Python; ``more`` (a server's version)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": _memory_gib(),
        "load_1m_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **more,
    }


def spread(values: Sequence[float]) -> dict[str, Any]:
    """A figure over repeated runs: median, least and most, and the range as a share of the median."""
    med = statistics.median(values)
    return {
        "median": round(med, 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "spread": round((max(values) - min(values)) / med, 3) if med else None,
        "runs": [round(v, 3) for v in values],
    }


def median_run(runs: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    """The run whose ``key`` is the median (the lower of the two middle ones for an even count): a whole run's
    figures, consistent with each other, rather than medians taken figure by figure."""
    ranked = sorted(runs, key=key)
    return ranked[(len(ranked) - 1) // 2]

"""User reward functions (verl's ``compute_score`` convention) that the reward tests register by import path."""

from __future__ import annotations

import time
from typing import Any


def busy(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    """Holds the worker for ``params.busy_s`` and scores 1 when the response is the ground truth."""
    time.sleep(float(extra_info["params"].get("busy_s", 0.01)))
    return float(solution_str.strip() == str(ground_truth).strip())


def broken(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
    raise RuntimeError("this reward function always fails")


async def verdict(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]) -> dict:
    return {"score": 0.5, "detail": "async functions and dict results work too"}

"""A reward function (verl's ``compute_score`` convention) that the verl tests' jobs score with: the simulated
engines' placeholder replies all lose the coin game, and GRPO needs rewards that differ within a group."""

from __future__ import annotations

from typing import Any


def sample_number(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any]
) -> float:
    """The trajectory's sample number in its group (Loom names trajectory s of group g ``t<g>-s<s>``)."""
    return float(extra_info["traj_id"].rsplit("-s", 1)[1])

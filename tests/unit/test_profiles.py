"""Interference factors simulated on the engine model."""

from __future__ import annotations

import numpy as np

from loom.policies.profiles import placement_profile, simulate_group


def test_factor_starts_at_one_and_never_falls() -> None:
    p = placement_profile(
        "qwen3-8b", "h100", 1, context_len=4096, max_running=256, tool_s=0.43, max_group=300
    )
    f = p.interference
    assert f[0] == 0.0 and f[1] == 1.0
    assert np.all(np.diff(f[1:]) >= 0)
    assert p.per_token_s > 0


def test_a_full_kv_cache_makes_the_group_queue() -> None:
    """32B on one H100 holds only a few long contexts: past that, trajectories wait for each other."""
    few = simulate_group("qwen3-32b", "h100", 1, 2, context_len=8192, tool_s=0.2, max_running=256)
    many = simulate_group("qwen3-32b", "h100", 1, 16, context_len=8192, tool_s=0.2, max_running=256)
    assert many > 3 * few


def test_more_tensor_parallelism_means_less_interference() -> None:
    kw = {"context_len": 16384, "max_running": 256, "tool_s": 0.43, "max_group": 64}
    tp1 = placement_profile("qwen3-14b", "h100", 1, **kw)  # type: ignore[arg-type]
    tp8 = placement_profile("qwen3-14b", "h100", 8, **kw)  # type: ignore[arg-type]
    assert tp8.per_token_s < tp1.per_token_s
    assert tp8.interference[64] < tp1.interference[64]

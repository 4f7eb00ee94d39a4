"""Worker profiles: the closed form placement prices by, and the group simulation on the engine model."""

from __future__ import annotations

import numpy as np
import pytest

from loom.engine.model.perf import PerfModel
from loom.policies.profiles import placement_profile, simulate_group


@pytest.mark.parametrize("simulated", [False, True])
def test_factor_starts_at_one_and_never_falls(simulated: bool) -> None:
    p = placement_profile(
        "qwen3-8b",
        "h100",
        1,
        context_len=4096,
        max_running=256,
        tool_s=0.43,
        max_group=300,
        simulated=simulated,
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


@pytest.mark.parametrize("simulated", [False, True])
def test_more_tensor_parallelism_means_less_interference(simulated: bool) -> None:
    kw = {"context_len": 16384, "max_running": 256, "tool_s": 0.43, "max_group": 64, "simulated": simulated}
    tp1 = placement_profile("qwen3-14b", "h100", 1, **kw)  # type: ignore[arg-type]
    tp8 = placement_profile("qwen3-14b", "h100", 8, **kw)  # type: ignore[arg-type]
    assert tp8.per_token_s < tp1.per_token_s
    assert tp8.interference[64] < tp1.interference[64]


def test_the_profile_drains_work_at_the_engines_full_batch_rate() -> None:
    """A saturated worker's group drains at the full-batch decode rate, the head
    runs at the per-token time of the batch it shares, and a short trajectory still takes a batch slot.
    With no tool calls every trajectory of the group is generating."""
    kw = {"context_len": 16384, "max_running": 256, "tool_s": 0.0, "max_group": 2000}
    for tp in (1, 8):
        p = placement_profile("qwen3-14b", "h100", tp, **kw)  # type: ignore[arg-type]
        perf = PerfModel("h100", "qwen3-14b", tp)
        batch = int(p.saturation)
        assert batch == min(256, perf.kv_capacity_tokens() // 16384)
        assert p.per_token_s * p.work_rate == pytest.approx(perf.per_token_time(batch, 16384) / batch)
        assert p.interference[batch] == pytest.approx(perf.interference(batch, 16384), rel=1e-6)
        # Past saturation the head's time grows with the group: the rest queue for its slots.
        assert p.interference[2 * batch] == pytest.approx(2 * p.interference[batch], rel=0.02)
        # A trajectory takes at least a batch slot; its context is its share of the KV cache.
        assert p.min_weight == pytest.approx(p.saturation / 256)
        assert p.weight_scale == pytest.approx(min(1.0, p.saturation * 16384 / perf.kv_capacity_tokens()))
        # A prefill chunk riding a full decode batch costs at most what it costs alone.
        assert 0 < p.prefill_s <= perf.iteration_time(8192, 0, 0) / 8192


def test_the_profile_counts_only_the_trajectories_generating() -> None:
    """Trajectories in a tool call leave the batch: the longer the tools against a step's generation, the
    fewer share it, and a group sharing it with none runs at the base rate."""
    kw = {"context_len": 4096, "max_running": 256, "max_group": 600}
    f = {
        tool: placement_profile("qwen3-14b", "h100", 2, tool_s=tool, **kw).interference  # type: ignore[arg-type]
        for tool in (0.0, 1.0, 10.0, 1e6)
    }
    for g in (8, 64, 200, 600):
        assert f[0.0][g] > f[1.0][g] > f[10.0][g] >= f[1e6][g]
    assert f[1e6][600] == pytest.approx(1.0, abs=0.01)

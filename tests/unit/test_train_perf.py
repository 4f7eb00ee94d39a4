"""The training stage's prices: RollArt Table 3 for weight sync, Figure 3 for the update's MFU."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.engine.model import train_perf
from loom.engine.model.perf import model_config
from loom.engine.model.train_perf import TABLE3, TrainStage, sequence_flops, weight_sync_s
from loom.workloads.base import WorkStep, cap_context
from tests.conftest import need_shared


@pytest.mark.parametrize("row,model", list(zip(TABLE3, ("qwen3-8b", "qwen3-14b", "qwen3-32b"), strict=True)))
def test_weight_sync_reproduces_table3(row: tuple[float, float, float], model: str) -> None:
    gib, tcp, rdma = row
    assert model_config(model).weight_bytes / 2**30 == pytest.approx(gib, abs=0.01)
    assert weight_sync_s(model, "tcp") == pytest.approx(tcp, rel=2e-3)
    assert weight_sync_s(model, "rdma") == pytest.approx(rdma, rel=2e-3)


def test_weight_sync_grows_with_size_and_refuses_unknown_links() -> None:
    small, large = weight_sync_s("qwen3-0.6b", "tcp"), weight_sync_s("qwen3-32b", "tcp")
    assert 0 < small < weight_sync_s("qwen3-8b", "tcp") < large
    with pytest.raises(ValueError, match="unknown link"):
        weight_sync_s("qwen3-8b", "carrier-pigeon")


def test_update_time_is_flops_over_the_gpus_achieved_rate() -> None:
    stage = TrainStage("qwen3-8b", "h800", 32, 0.1)
    m = model_config("qwen3-8b")
    want = 4 * (sequence_flops(m, 1000) + sequence_flops(m, 3000)) / (32 * 989e12 * 0.1)
    assert stage.step_s([1000, 3000]) == pytest.approx(want)
    # Twice the GPUs halve it; attention makes one long sequence dearer than two halves.
    assert TrainStage("qwen3-8b", "h800", 64, 0.1).step_s([1000, 3000]) == pytest.approx(want / 2)
    assert stage.step_s([8000]) > stage.step_s([4000, 4000])
    with pytest.raises(ValueError):
        TrainStage("qwen3-8b", "h800", 0)
    with pytest.raises(ValueError, match="unknown GPU"):
        TrainStage("qwen3-8b", "tpu")


def test_mfu_is_calibrated_to_rollart_figure3() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    from loom.workloads import coding

    w = coding(prompts=128, group_size=1, siblings="replay")  # the recorded runs
    contexts = [dataclasses.replace(t, steps=cap_context(t.steps)).final_context for t in w.trajectories]
    assert len(contexts) == 128
    assert train_perf.calibrate_mfu(contexts) == pytest.approx(train_perf.MFU, rel=0.01)
    assert TrainStage("qwen3-8b", "h800", 32).step_s(contexts) == pytest.approx(0.23 * 365.7, rel=0.01)


steps_st = st.lists(
    st.tuples(st.integers(1, 40_000), st.integers(1, 20_000), st.floats(0, 10)), min_size=1, max_size=12
)


@settings(max_examples=200, deadline=None)
@given(raw=steps_st, limit=st.integers(100, 40_000))
def test_cap_context_keeps_a_prefix_within_the_limit(raw: list[tuple[int, int, float]], limit: int) -> None:
    steps = tuple(WorkStep(i, o, e) for i, o, e in raw)
    out = cap_context(steps, limit)
    assert all(s.input_len + s.output_len <= limit for s in out)
    assert not out or out[-1].env_s == 0.0
    # Every call but the last is the original; the last is the original cut to fit.
    assert out[:-1] == steps[: max(0, len(out) - 1)]
    if out:
        orig = steps[len(out) - 1]
        assert out[-1].input_len == orig.input_len and out[-1].output_len <= orig.output_len
        if out[-1].output_len < orig.output_len:
            assert out[-1].input_len + out[-1].output_len == limit
    # Nothing is cut short of the limit: brute force the first call that reaches it, the last to run.
    cross = next((k for k, s in enumerate(steps) if s.input_len + s.output_len >= limit), None)
    if cross is None:
        assert len(out) == len(steps)
    else:
        assert len(out) == cross + (steps[cross].input_len < limit)

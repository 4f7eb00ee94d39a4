"""The performance model: calibration against published points, interference factor, KV transfers."""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.bench.engine_calibration import (
    MEASURED,
    MEASURED_MODELS,
    POINTS,
    calibration_report,
    fit,
    fit_measured,
    interference_errors,
    measured_points,
)
from loom.engine.model.interference import context_bucket, interference_table
from loom.engine.model.perf import EFFICIENCY, GPUS, MODELS, Efficiency, PerfModel

PROPS = settings(max_examples=120, deadline=None)


@pytest.mark.parametrize(
    ("model", "tok_s", "tolerance"),
    [("qwen3-8b", 81.7, 0.10), ("qwen3-14b", 47.1, 0.15), ("qwen3-32b", 20.7, 0.15)],
)
def test_decode_speed_matches_published_h20_batch1(model: str, tok_s: float, tolerance: float) -> None:
    # Qwen's benchmark: batch 1, 2,048 generated tokens after a one-token prompt.
    perf = PerfModel("h20", model)
    assert 2048 / perf.decode_span(1, 1, 2048) == pytest.approx(tok_s, rel=tolerance)


def test_every_calibration_point_within_five_percent() -> None:
    report = calibration_report()
    assert len(report) == len(POINTS) == 8
    assert {(c.point.gpu, c.point.model) for c in report} == {
        ("h20", "qwen3-8b"),
        ("h20", "qwen3-14b"),
        ("h20", "qwen3-32b"),
        ("h100", "llama-2-7b"),
    }
    assert max(abs(c.rel_error) for c in report) < 0.05


def test_recorded_efficiencies_are_the_fit() -> None:
    fitted = fit()
    recorded = {"default": Efficiency(), "h20": EFFICIENCY["h20"]}
    for kind in ("default", "h20"):
        for name in ("compute", "memory", "exposed", "overhead_s"):
            assert getattr(recorded[kind], name) == pytest.approx(getattr(fitted[kind], name), rel=0.01)

    def loss(table: dict[str, Efficiency]) -> float:
        return sum(c.rel_error**2 for c in calibration_report(table))

    assert loss(recorded) <= 1.05 * loss(fitted)


def test_param_counts_match_published_sizes() -> None:
    billions = {name: m.params / 1e9 for name, m in MODELS.items()}
    assert billions == pytest.approx(
        {"qwen3-0.6b": 0.6, "qwen3-8b": 8.2, "qwen3-14b": 14.8, "qwen3-32b": 32.8, "llama-2-7b": 6.74},
        rel=0.02,
    )


@pytest.mark.parametrize("gpu", ["h100", "h800", "h20", "h200", "a100"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_iteration_time_is_monotone_in_batch(gpu: str, tp: int) -> None:
    perf = PerfModel(gpu, "qwen3-8b", tp)
    decode = [perf.iteration_time(0, b, b * 2000) for b in range(1, 513)]
    prefill = [perf.iteration_time(p, 8, 16000) for p in range(0, 16384, 97)]
    assert decode == sorted(decode) and decode[0] < decode[-1]
    assert prefill == sorted(prefill) and prefill[0] < prefill[-1]


@given(
    seqs=st.integers(1, 300), kv=st.integers(0, 500_000), n=st.integers(0, 400), tp=st.sampled_from([1, 2, 8])
)
@PROPS
def test_decode_span_is_the_sum_of_iterations(seqs: int, kv: int, n: int, tp: int) -> None:
    perf = PerfModel("h20", "qwen3-14b", tp)
    expected = sum(perf.iteration_time(0, seqs, kv + i * seqs) for i in range(n))
    assert perf.decode_span(seqs, kv, n) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@given(
    seqs=st.integers(1, 300),
    kv=st.integers(0, 500_000),
    n=st.integers(0, 200),
    tp=st.sampled_from([1, 2, 8]),
    positions=st.floats(1.0, 9.0),
)
@PROPS
def test_a_span_of_verification_steps_is_their_sum(
    seqs: int, kv: int, n: int, tp: int, positions: float
) -> None:
    perf = PerfModel("h100", "qwen3-14b", tp)
    expected = sum(perf.verify_time(seqs, kv + i * seqs, positions) for i in range(n))
    assert perf.decode_span(seqs, kv, n, positions) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert perf.verify_time(seqs, kv, 1.0) == pytest.approx(perf.iteration_time(0, seqs, kv), rel=1e-12)
    assert perf.verify_time(seqs, kv, 1.0) <= perf.verify_time(seqs, kv, positions)
    assert perf.verify_time(seqs, kv, positions) <= positions * perf.verify_time(seqs, kv, 1.0) + 1e-12


@pytest.mark.parametrize("gpu", sorted(MEASURED))
def test_verification_grows_with_positions_as_measured(gpu: str) -> None:
    """Each drafted position's cost, model against the measured table (measured/README.md), from two positions
    on at every measured batch: within 8% on both GPUs. (The measured step from one position to two also
    switches the profile from FlashAttention to torch's memory-efficient kernel, which only this
    implementation pays, so it is left out.) The single roofline of a decode iteration, which lets the extra
    positions hide under the cache read, fell 17% short of the measured growth."""
    table = json.loads(MEASURED[gpu].read_text())
    checked = 0
    for m in table["models"]:
        points = {(v["batch"], v["positions"]): v["seconds"] for v in m.get("verify", ())}
        perf = PerfModel(gpu, m["model"])
        for (batch, positions), seconds in points.items():
            if positions <= 2 or (batch, 2) not in points:
                continue
            kv = batch * 4096
            model_growth = perf.verify_time(batch, kv, positions) / perf.verify_time(batch, kv, 2)
            measured_growth = seconds / points[(batch, 2)]
            assert model_growth == pytest.approx(measured_growth, rel=0.08), (m["model"], batch, positions)
            checked += 1
    assert checked >= 16


def test_kv_capacity_grows_with_memory_and_tp() -> None:
    one = PerfModel("h100", "qwen3-8b").kv_capacity_tokens()
    assert 300_000 < one < 500_000
    assert PerfModel("h100", "qwen3-8b", tp=2).kv_capacity_tokens() > 2 * one
    assert PerfModel("h200", "qwen3-8b").kv_capacity_tokens() > one
    assert PerfModel("h100", "qwen3-8b").kv_capacity_tokens(mem_fraction=0.5) < one


# Interference


@given(
    gpu=st.sampled_from(sorted(GPUS)),
    model=st.sampled_from(sorted(MODELS)),
    tp=st.sampled_from([1, 2, 4, 8]),
    context=st.integers(0, 64_000),
    batches=st.lists(st.integers(1, 512), min_size=2, max_size=10),
)
@PROPS
def test_interference_is_one_alone_and_grows_with_batch(
    gpu: str, model: str, tp: int, context: int, batches: list[int]
) -> None:
    perf = PerfModel(gpu, model, tp)
    assert perf.interference(1, context) == 1.0
    ordered = sorted(batches)
    factors = [perf.interference(b, context) for b in ordered]
    assert factors == sorted(factors) and factors[0] >= 1.0
    assert perf.per_token_time(1, context) == perf.iteration_time(0, 1, context)


def test_interference_table_is_bucketed_cached_and_matches_the_model() -> None:
    assert [context_bucket(c) for c in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]
    table = interference_table("qwen3-8b", "h100", 2, 3000)
    assert interference_table("Qwen3-8B", "H100", 2, 4096) is table
    assert len(table.factors) == 256 and table.factor(1) == 1.0
    assert list(table.factors) == sorted(table.factors)
    perf = PerfModel("h100", "qwen3-8b", 2)
    assert table.base_s == perf.per_token_time(1, 4096)
    assert table.factor(64) == pytest.approx(perf.interference(64, 4096))
    with pytest.raises(ValueError):
        table.factor(257)


def test_tensor_parallel_lowers_per_token_time() -> None:
    times = [PerfModel("h100", "qwen3-32b", tp).per_token_time(1, 4096) for tp in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)


# KV transfer


def test_kv_transfer_time_is_bytes_over_bandwidth() -> None:
    perf = PerfModel("h100", "qwen3-8b")
    nbytes = 10_000 * perf.model.kv_bytes_per_token
    assert perf.kv_transfer_time(10_000, bandwidth_gbps=50) == pytest.approx(nbytes / 50e9)
    # Default: one direction of NVLink (900 GB/s both ways) at the link efficiency.
    assert perf.kv_transfer_time(10_000) == pytest.approx(nbytes / (450e9 * perf.efficiency.link))
    # Each rank sends its own shard in parallel.
    assert PerfModel("h100", "qwen3-8b", 2).kv_transfer_time(10_000, 50) == pytest.approx(nbytes / 2 / 50e9)
    with pytest.raises(ValueError):
        perf.kv_transfer_time(1, bandwidth_gbps=0)


def test_interference_matches_the_measured_h200_table() -> None:
    """Heddle's F from the recorded model against F measured on an H200 (measured/README.md): the engine the
    benchmarks simulate slows a batch down as a real GPU does. 0.6B is not held to it: the measured
    implementation's unfused kernels dominate so small a model."""
    errors = interference_errors("h200")
    assert set(errors) == {"qwen3-0.6b", *MEASURED_MODELS}
    for name in MEASURED_MODELS:
        assert len(errors[name]) >= 7
        assert statistics.median(abs(e) for e in errors[name]) < 0.08, name
        assert max(abs(e) for e in errors[name]) < 0.40, name


def test_interference_on_the_measured_h100_errs_on_the_cautious_side() -> None:
    """On the H100 the profile's fixed cost (3.7 ms of unfused kernels, fitted) is a larger share of a
    batch-1 step, so the measured F is lower than the recorded model's by up to 30% at 8B: the model never
    makes batching look cheaper than measured by more than 5%. With the efficiencies fitted to the H100
    table, F is within 9% everywhere. (32B fits only batch 1 beside its weights: no F to compare.)"""
    for name, errors in interference_errors("h100").items():
        if name in MEASURED_MODELS and errors:
            assert min(errors) > -0.05 and max(errors) < 0.30, name
    eff, _ = fit_measured("h100")
    for name in ("qwen3-8b", "qwen3-14b"):
        points = [p for p in measured_points("h100") if p.model == name and not p.prefill_tokens]
        base = {p.context: p.seconds for p in points if p.batch == 1}
        perf = PerfModel("h100", name, 1, eff)
        for p in points:
            if p.batch > 1 and p.context in base:
                measured_f = p.seconds / base[p.context]
                assert perf.interference(p.batch, p.context) == pytest.approx(measured_f, rel=0.09), p


@pytest.mark.parametrize(
    ("gpu", "most", "median", "count"), [("h200", 0.20, 0.06, 55), ("h100", 0.15, 0.05, 40)]
)
def test_the_roofline_explains_measured_iteration_times(
    gpu: str, most: float, median: float, count: int
) -> None:
    """Fitted to a measured table, the model's form (roofline, exposed fraction, fixed overhead) reproduces
    every 8B-32B decode and prefill iteration within ``most``, half of them within ``median``."""
    eff, errors = fit_measured(gpu)
    points = measured_points(gpu)
    assert len(errors) == sum(p.model in MEASURED_MODELS for p in points) >= count
    assert statistics.median(abs(e) for e in errors) < median
    assert max(abs(e) for e in errors) < most
    # The fitted memory rate never beats the card's own copy rate, measured in the same run.
    copy_tb_s = json.loads(MEASURED[gpu].read_text())["ceilings"]["copy_tb_s"]
    assert eff.memory > 0.3 and eff.memory * GPUS[gpu].mem_bw_tbps < copy_tb_s

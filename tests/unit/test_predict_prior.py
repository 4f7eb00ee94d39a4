"""The length regressor's bag-of-tokens prior: its features, its closed-form fit, and cross-fitting that keeps
each task's own lengths out of the prior its training examples see."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.predict import context, regressor, train
from loom.predict.dataset import Example


@functools.cache
def _with_buckets(buckets: int) -> regressor.LengthRegressor:
    return regressor.LengthRegressor(regressor.RegressorConfig(bag_buckets=buckets))


def _examples(totals: dict[str, int], seed: int = 0) -> list[Example]:
    """Three steps per task; token 7 appears in the context of the long tasks only."""
    rng = np.random.default_rng(seed)
    out = []
    for task, total in totals.items():
        for step in range(3):
            ids = rng.integers(100, 5000, size=40)
            if total > 5000:
                ids[:5] = 7
            feats = context.features(step, 10 * step, 40)
            out.append(Example(task, f"{task}#0", step, ids.astype(np.int64), feats, 10 * step, total))
    return out


def test_bag_features_count_each_unpadded_token_once() -> None:
    ids, mask = context.batch([np.array([3, 3, 5, 3 + 16]), np.array([9])], regressor.PAD_ID, 8)
    x = regressor.bag_features(torch.from_numpy(ids), torch.from_numpy(mask), 16).numpy()
    want = np.log1p(np.bincount([3, 3, 5, 3], minlength=16))
    assert np.allclose(x[0], want / np.linalg.norm(want))
    assert np.allclose(x[1], np.log1p(np.eye(16)[9]))  # shorter than unit length: left as it is


@settings(deadline=None)  # the first example builds what later ones reuse
@given(
    st.lists(st.lists(st.integers(0, 200), min_size=1, max_size=64), min_size=1, max_size=4),
    st.sampled_from([8, 64, 1024]),
    st.integers(0, 2**31),
)
def test_the_prior_summed_over_tokens_equals_the_dense_bag(
    rows: list[list[int]], buckets: int, seed: int
) -> None:
    model = _with_buckets(buckets)
    beta = torch.from_numpy(np.random.default_rng(seed).normal(size=buckets)).float()
    model.bag_beta.copy_(beta)
    ids, mask = context.batch([np.array(r, dtype=np.int64) for r in rows], regressor.PAD_ID, 8)
    i, m = torch.from_numpy(ids), torch.from_numpy(mask)
    dense = regressor.bag_features(i, m, buckets) @ beta + model.bag_mean
    assert torch.allclose(model.prior(i, m), dense, atol=1e-4)


def test_the_prior_learns_a_telling_token_for_unseen_tasks() -> None:
    totals = {f"t{i}": (20_000 if i % 2 else 2_000) for i in range(40)}
    model = regressor.build("tiny")
    train.fit_prior(model, _examples(totals), train.TrainConfig(prior_alpha=0.1))
    unseen = _examples({"long": 20_000, "short": 2_000}, seed=1)
    ids, mask, _ = context.inputs(unseen, regressor.PAD_ID, model.cfg.pool)
    with torch.no_grad():
        prior = model.prior(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    assert prior[:3].min() > prior[3:].max()


def test_a_tasks_training_prior_never_saw_its_own_lengths() -> None:
    totals = {f"t{i}": (20_000 if i % 2 else 2_000) for i in range(40)}
    base = _examples(totals)
    cfg = train.TrainConfig()
    before = train.fit_prior(regressor.build("tiny"), base, cfg)
    changed = [dataclasses.replace(e, total=1) if e.task_id == "t3" else e for e in base]
    after = train.fit_prior(regressor.build("tiny"), changed, cfg)
    own = [i for i, e in enumerate(base) if e.task_id == "t3"]
    others = [i for i in range(len(base)) if i not in own]
    assert torch.allclose(before[own], after[own])
    assert not torch.allclose(before[others], after[others])


@pytest.mark.parametrize("buckets", [0, 64])
def test_a_saved_regressor_loads_with_its_prior(tmp_path: Path, buckets: int) -> None:
    model = regressor.LengthRegressor(regressor.RegressorConfig(bag_buckets=buckets))
    if buckets:
        model.bag_beta.normal_()
    regressor.save(model, tmp_path)
    loaded = regressor.load(tmp_path)
    assert loaded.cfg.bag_buckets == buckets
    assert torch.equal(loaded.bag_beta, model.bag_beta)


def test_a_text_gate_opens_only_where_the_summary_lowers_that_steps_validation_loss() -> None:
    totals = {f"t{i}": 1000 * (i + 1) for i in range(12)}
    val = _examples(totals, seed=2) + [
        dataclasses.replace(e, step=e.step + 3, features=context.features(e.step + 3, 0, 40))
        for e in _examples(totals, seed=3)
    ]
    model = regressor.build("tiny", seed=1).eval()
    model.text_gate.fill_(1.0)
    chosen = train.select_text_gates(model, val, 8)
    assert set(chosen) <= {0.0, 1.0}
    opened = 0
    serving = train.gate_of(model, val)
    for k, gate in enumerate(chosen):
        at_k = [e for e, g in zip(val, serving, strict=True) if g == k]
        if not at_k:
            assert gate == 1.0  # no evidence: the summary stays as it was trained
        elif gate:
            opened += 1
            model.text_gate[k] = 0.0
            off = train._val_loss(model, at_k, 8)
            model.text_gate[k] = 1.0
            assert train._val_loss(model, at_k, 8) < off
    assert opened


def test_each_step_is_served_by_the_gate_of_its_range() -> None:
    model = _with_buckets(8)
    steps = list(range(0, 200))
    feats = torch.from_numpy(np.stack([context.features(k, 10 * k, 100) for k in steps]))
    want = [sum(b <= k for b in model.cfg.gate_bounds) for k in steps]
    assert model.gate_of(feats).tolist() == want
    assert want[:4] == [0, 1, 2, 3] and want[-1] == len(model.cfg.gate_bounds)


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 10), st.floats(0.01, 10)), min_size=1, max_size=30))
def test_summary_wins_is_certain_when_it_wins_everywhere_and_never_when_it_never_does(
    rows: list[tuple[int, float, float]],
) -> None:
    trajs = [f"t{t}" for t, _, _ in rows]
    off = np.array([e for _, e, _ in rows])
    gain = np.array([g for _, _, g in rows])
    assert train.summary_wins(off + gain, off, trajs, samples=100) == 1.0
    assert train.summary_wins(off, off + gain, trajs, samples=100) == 0.0
    assert train.summary_wins(off, off, trajs, samples=100) == 0.0
    noisy = off + np.where(np.arange(len(off)) % 2, gain, -gain)
    assert (
        train.summary_wins(off, noisy, trajs, samples=100)
        + train.summary_wins(noisy, off, trajs, samples=100)
        <= 1.0
    )

"""The harness's learned predictor: cross-fitted by prompt, read as the service would be sent, cached."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loom.bench.harness import learned, served
from loom.bench.harness.cluster import Cluster
from loom.bench.harness.rollout import _Predictor, run_rollout
from loom.data.trace_sets import trace_set
from loom.data.traces import prompt_of
from loom.protocol import PolicySpec
from loom.workloads import coding, search
from loom.workloads.base import Workload
from tests.conftest import need_shared

TRACE_FILES = (
    "swe-gemini3pro.jsonl.gz",
    "hotpotqa-react-100q-5trials.txt.gz",
    "tau-bench-airline-gpt4o.json.gz",
)


def test_folds_split_prompts_not_trials() -> None:
    need_shared("data/traces/tau-bench-airline-gpt4o.json.gz")
    folds = {}
    for t in trace_set("tool_use"):
        folds.setdefault(prompt_of(t), set()).add(learned.fold_of(prompt_of(t), 5))
    assert all(len(f) == 1 for f in folds.values())  # every trial of a prompt in one fold
    assert {f for fs in folds.values() for f in fs} == set(range(5))


def test_a_varied_sibling_is_read_as_its_own_sequence_of_recorded_steps() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    w = coding(prompts=1, group_size=16)
    trace = {t.id: t for t in trace_set("coding")}[w.trajectories[0].trace]
    for t in w.trajectories:
        queries = learned._queries(t, trace, {})
        assert len(queries) == len(t.steps)
        generated = 0
        assert [k for k, _, _ in queries] == list(range(len(t.steps)))
        for k, _, feats in queries:
            assert feats[0] == pytest.approx(np.log1p(k)) and feats[1] == pytest.approx(
                np.log1p(generated) / 10
            )
            generated += t.steps[k].output_len
        # An evaluation asks at a few steps only: those the trajectory reaches.
        some = learned._queries(t, trace, {}, steps=(0, 2, 10_000))
        assert [k for k, _, _ in some] == [k for k in (0, 2) if k < len(t.steps)]


def test_cross_fitted_predictions_cover_every_step_are_cached_and_drive_a_rollout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for f in TRACE_FILES:
        need_shared(f"data/traces/{f}")
    monkeypatch.setenv("LOOM_HOME", str(tmp_path))
    budget = learned.Budget(steps_per_fold=2, folds=2)
    w = Workload("mini", "", coding(prompts=2, group_size=4).trajectories + search(prompts=2).trajectories)
    logs: list[str] = []
    got = learned.cross_fitted(w, budget, logs.append)
    pred = got.totals
    # A first run says what it is about to do and how long it takes before it trains anything (it used to be
    # silent for 14 minutes), then each fold as it ends, with the time left.
    assert "training 2 of 2 fold models" in logs[0] and "about" in logs[0] and "cached" in logs[0]
    assert [m.split(":")[0] for m in logs[1:]] == [
        "learned predictor fold 1/2",
        "learned predictor",
        "learned predictor fold 2/2",
    ]
    assert "1 fold(s) to go, about" in logs[2] and got.admission_log_sd > 0
    for t in w.trajectories:
        done = np.cumsum([0, *(s.output_len for s in t.steps[:-1])])
        assert pred[t.id].shape == (len(t.steps),) and np.all(pred[t.id] >= done)  # generated + remaining
    again = learned.cross_fitted(w, budget, logs.append)
    assert len(logs) == 4 and all(np.array_equal(pred[k], again.totals[k]) for k in pred)  # from the cache
    r = run_rollout(
        w, PolicySpec(preset="heddle").resolved(), Cluster(gpus=4, model="qwen3-8b"), "learned", learned=got
    )
    assert r.output_tokens == sum(t.output_tokens for t in w.trajectories)
    with pytest.raises(ValueError, match="name no recorded trace"):
        learned.cross_fitted(Workload("x", "", [w.trajectories[0].__class__("a", "p", 0, ())]), budget)
    # What the service serves: a combiner per fold over the same text models, fitted without the fold's
    # prompts, cached beside them; the harness asks it with what the run knows of each group.
    rows = {"coding": 2, "search": 3, "tool_use": 3}
    got = served.served(w, budget, rows)
    assert len(got.combiners) == 2 and 0 <= got.admission_slope <= 1 and got.admission_log_sd > 0
    assert [c.to_json() for c in served.fold_combiners(budget, rows)] == [c.to_json() for c in got.combiners]
    pred = _Predictor("learned", got, "coding")
    sample, *others = [t for t in w.trajectories if t.prompt == w.trajectories[0].prompt]
    assert pred.total(sample, 500, 3) >= 500
    pred.total(others[0], 200, 1)  # a sibling's estimate records its progress
    known = pred.known(sample, 700, 4)
    assert known.running == ((1, 200.0),) and known.finished == () and known.history == ()
    assert known.model_total == got.totals[sample.id][4] and known.workload == "coding"
    pred.finished(others[1])
    pred.finished(others[0])
    known = pred.known(sample, 900, 5)  # the finished, in the order they finished, and no longer running
    assert known.finished == (others[1].output_tokens, others[0].output_tokens) and known.running == ()
    r = run_rollout(
        w, PolicySpec(preset="heddle").resolved(), Cluster(gpus=4, model="qwen3-8b"), "learned", learned=got
    )
    assert r.output_tokens == sum(t.output_tokens for t in w.trajectories)


def test_a_batch_is_ranked_by_one_combiner_and_every_fold_trains_on_every_set() -> None:
    """The combiner folds deal whole batches round the folds (a batch mixing combiners is ranked by
    estimates that differ by more than their order); a set with fewer batches than folds deals its prompts."""
    budget = learned.Budget(folds=3)
    prompts = {"search": 40, "tool_use": 8}
    fold = served.combiner_folds(budget, prompts)
    for name, w in served.row_workloads(prompts, budget.seed).items():
        keys = [served.prompt_key(s[0]) for s in w.by_prompt().values()]
        batches = [keys[i : i + served.BATCH_PROMPTS] for i in range(0, len(keys), served.BATCH_PROMPTS)]
        if name == "search":  # five batches over three folds: each whole, every fold holds one or two
            assert all(len({fold[k] for k in b}) == 1 for b in batches)
            assert sorted(Counter(fold[b[0]] for b in batches).values()) == [1, 2, 2]
        else:  # one batch: its prompts dealt one by one
            assert set(fold[k] for k in keys) == {0, 1, 2}

"""The length predictor's pieces that need no model: context windows, dataset splits, metrics, batching."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.data.traces import Trace, TraceStep
from loom.predict import context, dataset, evaluate
from loom.predict.batcher import MicroBatcher
from tests.conftest import need_shared


@given(st.lists(st.text(max_size=9000), min_size=1, max_size=12))
def test_clip_pieces_keeps_the_newest_that_fit(pieces: list[str]) -> None:
    kept = context.clip_pieces(pieces)
    assert kept[-1] == pieces[-1][-context.PIECES_CHARS :]
    assert sum(map(len, kept)) <= context.PIECES_CHARS
    # Whole pieces, newest last, no gaps.
    assert kept[:-1] == pieces[len(pieces) - len(kept) : -1]


@given(
    st.lists(st.integers(0, 1000), max_size=900),
    st.lists(st.lists(st.integers(0, 1000), max_size=700), max_size=6),
)
def test_window_is_prompt_head_and_context_tail(prompt: list[int], pieces: list[list[int]]) -> None:
    w = context.window(prompt, pieces)
    flat = [i for p in pieces for i in p]
    head = prompt[: context.HEAD_TOKENS]
    assert w.tolist()[: len(head)] == head
    tail = w.tolist()[len(head) :]
    assert tail == flat[len(flat) - len(tail) :]
    assert len(tail) == min(len(flat), context.TAIL_TOKENS)


def test_batch_left_pads_to_the_pool_multiple() -> None:
    ids, mask = context.batch([np.array([5, 6, 7]), np.arange(1, 40)], pad_id=99, multiple=32)
    assert ids.shape == (2, 64)
    assert ids[0, -3:].tolist() == [5, 6, 7] and (ids[0, :-3] == 99).all()
    assert mask.sum(1).tolist() == [3, 39]


def test_step_pieces_hold_the_action_but_not_its_observation() -> None:
    acts, obs = ["a0", "a1", "a2"], ["o0", "o1", "o2"]
    assert context.step_pieces(acts, obs, 0) == []
    assert context.step_pieces(acts, obs, 2) == ["a0\n", "o0\n", "a1\n"]


def _trace(tid: str, outs: list[int]) -> Trace:
    steps = tuple(
        TraceStep(
            prompt_tokens=100 + 50 * i, completion_tokens=n, action=f"a{i}", observation=f"o{i}", created=0
        )
        for i, n in enumerate(outs)
    )
    return Trace(tid, True, "Submitted", steps, task=f"fix {tid}")


def test_examples_count_what_was_generated_before_each_step() -> None:
    ex = dataset.trajectory_examples(_trace("x", [10, 20, 30]))
    assert [(e.step, e.generated, e.remaining) for e in ex] == [(0, 0, 60), (1, 10, 50), (2, 30, 30)]
    # The context length a step reports is the last call's prompt and output, not the next prompt.
    assert ex[2].features[2] == pytest.approx(np.log1p(150 + 20) / 10, rel=1e-6)


def test_splits_are_by_task_and_deterministic() -> None:
    traces = [_trace(f"t{i}#{trial}", [5, 5]) for i in range(60) for trial in range(2)]
    data = dataset.build(traces)
    tasks = {k: {e.task_id for e in v} for k, v in data.items()}
    assert not (tasks["train"] & tasks["test"]) and not (tasks["train"] & tasks["val"])
    assert not (tasks["val"] & tasks["test"])
    assert all(tasks.values())
    assert dataset.build(traces)["test"][0].traj_id == data["test"][0].traj_id


def test_swe_dataset_holds_every_prediction_point() -> None:
    from loom.data.traces import load_traces

    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    traces = list(load_traces().values())[:5]
    data = dataset.build(traces)
    assert sum(len(v) for v in data.values()) == sum(len(t.steps) for t in traces)
    assert all(0 < len(e.ids) <= context.HEAD_TOKENS + context.TAIL_TOKENS for v in data.values() for e in v)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=10, max_size=60, unique=True))
def test_tail_recall_is_one_for_any_monotone_predictor(actual: list[float]) -> None:
    assert evaluate.tail_recall([3 * a + 1 for a in actual], actual) == 1.0
    assert evaluate.tail_recall([-a for a in actual], actual) == 0.0


def test_pearson_of_a_constant_predictor_is_zero() -> None:
    assert evaluate.pearson([5.0] * 10, list(range(10))) == 0.0
    assert evaluate.pearson(list(range(10)), list(range(10))) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        evaluate.pearson([1.0], [1.0])


async def test_micro_batcher_groups_concurrent_requests() -> None:
    sizes: list[int] = []
    b: MicroBatcher[int, int] = MicroBatcher(lambda xs: [x * 2 for x in xs], max_batch=8, max_wait_s=0.05)
    b.on_batch = lambda n, _s: sizes.append(n)
    out = await asyncio.gather(*(b.submit(i, 5.0) for i in range(20)))
    await b.close()
    assert out == [2 * i for i in range(20)]
    assert max(sizes) == 8 and sum(sizes) == 20


async def test_micro_batcher_fails_requests_past_their_deadline_and_isolates_errors() -> None:
    def slow(xs: list[int]) -> list[int]:
        import time

        time.sleep(0.2)
        if 13 in xs:
            raise ValueError("bad input")
        return xs

    b: MicroBatcher[int, int] = MicroBatcher(slow, max_batch=1, max_wait_s=0)
    first = asyncio.create_task(b.submit(1, 5.0))
    await asyncio.sleep(0.01)
    late = asyncio.create_task(b.submit(2, 0.05))  # queued behind a 0.2 s batch
    assert await first == 1
    with pytest.raises(TimeoutError):
        await late
    with pytest.raises(ValueError):
        await b.submit(13, 5.0)
    assert await b.submit(4, 5.0) == 4
    await b.close()


@given(
    st.lists(st.integers(0, 3), min_size=2, max_size=6),
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=6, max_size=6, unique=True),
    st.sampled_from([0.1, 0.34, 0.5]),
)
def test_tail_recall_averages_over_every_way_to_break_ties(
    predicted: list[int], actual: list[float], tail: float
) -> None:
    import itertools

    a = actual[: len(predicted)]
    k = max(1, round(len(a) * tail))
    top_a = set(np.argsort(-np.asarray(a), kind="stable")[:k].tolist())
    hits = [
        len(set(sorted(range(len(a)), key=lambda i: (-predicted[i], order[i]))[:k]) & top_a) / k
        for order in itertools.permutations(range(len(a)))
    ]
    assert evaluate.tail_recall(predicted, a, tail) == pytest.approx(float(np.mean(hits)))


@settings(deadline=None)
@given(
    st.lists(st.integers(0, 10**5), min_size=3, max_size=40),
    st.lists(st.integers(0, 10**5), min_size=40, max_size=40),
)
def test_bootstrap_interval_holds_the_resamples_and_a_predictor_never_beats_itself(
    actual: list[int], noise: list[int]
) -> None:
    predicted = [float(a + n) for a, n in zip(actual, noise, strict=False)]
    for metric in (evaluate.tail_recall, evaluate.pearson):
        iv = evaluate.bootstrap(metric, actual, predicted, samples=200)
        assert iv.estimate == pytest.approx(metric(predicted, actual))
        assert iv.low <= iv.high
        same = evaluate.bootstrap(metric, actual, predicted, predicted, samples=50)
        assert (same.estimate, same.low, same.high, same.above_zero) == (0.0, 0.0, 0.0, 0.0)


def test_bootstrap_separates_a_perfect_predictor_from_a_constant_one() -> None:
    actual = list(range(1, 101))
    iv = evaluate.bootstrap(evaluate.tail_recall, actual, actual, [1.0] * 100, samples=500)
    assert iv.estimate == pytest.approx(0.9)
    assert iv.low > 0.5 and iv.above_zero == 1.0
    # Fifteen trajectories: the top 10% is two, and a random ranking's interval spans 0 to at least 1/2.
    rng = np.random.default_rng(1)
    small = evaluate.bootstrap(evaluate.tail_recall, actual[:15], rng.permutation(15).tolist(), samples=500)
    assert small.low == 0.0 and small.high >= 0.5
    with pytest.raises(ValueError):
        evaluate.bootstrap(evaluate.pearson, [1.0, 2.0], [1.0])


def test_training_to_a_step_budget_gives_the_same_model_under_one_seed(tmp_path: Path) -> None:
    """The budget is steps, not minutes: two runs of one seed are the same model however long each took
    (a slower machine once got a third of the training and every cross-fitted benchmark moved with it)."""
    import torch

    from loom.predict import regressor, train

    traces = [_trace(f"t{i}#0", [5 + 7 * i, 40, 3 * i + 1]) for i in range(24)]
    data = dataset.build(traces)
    cfg = train.TrainConfig(max_steps=3, batch_size=8, seed=5)
    reports = [train.train(data["train"], data["val"], cfg, tmp_path / name) for name in ("a", "b")]
    assert [r.steps for r in reports] == [3, 3]
    a, b = (regressor.load(tmp_path / name).state_dict() for name in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = train.train(
        data["train"], data["val"], train.TrainConfig(max_steps=3, batch_size=8, seed=6), tmp_path / "c"
    )
    c = regressor.load(tmp_path / "c").state_dict()
    assert other.steps == 3 and not all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(ValueError, match="max_steps"):
        train.train(data["train"], data["val"], train.TrainConfig(max_steps=0), tmp_path / "d")

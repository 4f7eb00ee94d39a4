"""Whole training steps in virtual time: the modes keep the live loop's rules (bound, back-pressure, aborts)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loom.bench.harness.training import Mode, Pool, local_load_s, run_training
from loom.engine.model.train_perf import TrainStage
from loom.workloads.base import Workload, WorkStep, WorkTraj

MODEL = "qwen3-8b"
POOLS = [Pool("h800", 4, 1)]
TRAIN = TrainStage(MODEL, "h800", 2)


def _workload(groups: int = 24, size: int = 4, seed: int = 0) -> Workload:
    """Short and long multi-turn groups alternating, as a mixed data set has them."""
    rng = random.Random(seed)
    w = Workload("test", "synthetic")
    for g in range(groups):
        task = "long" if g % 2 else "short"
        for s in range(size):
            turns = rng.randint(6, 12) if task == "long" else rng.randint(1, 3)
            ctx, steps = 500, []
            for _ in range(turns):
                out = rng.randint(200, 2000) if task == "long" else rng.randint(20, 200)
                steps.append(WorkStep(ctx, out, rng.uniform(0.1, 2.0)))
                ctx += out + 100
            steps[-1] = WorkStep(steps[-1].input_len, steps[-1].output_len, 0.0)
            w.trajectories.append(WorkTraj(f"{g}#{s}", f"p{g}", s, tuple(steps), task=task))
    return w


def _run(mode: Mode, steps: int = 6, batch: int = 4):
    return run_training(_workload(), MODEL, POOLS, TRAIN, mode, batch, steps, warmup=1)


def test_sync_waits_for_the_whole_batch_and_never_aborts() -> None:
    r = _run(Mode.sync())
    assert r.steps == 6 and r.staleness_max == 0 and r.aborted_fraction == 0.0
    # With nothing overlapping, a step is its wait, its update and its weight sync, end to end.
    assert r.step_time_s == pytest.approx(r.wait_s + r.train_s + r.sync_s, rel=1e-6)
    assert all(s["trajectories"] == 4 * 4 for s in r.per_step)


def test_one_off_trains_on_the_batch_generated_one_version_back() -> None:
    r = _run(Mode.one_off())
    assert r.aborted_fraction == 0.0 and r.staleness_max == 1
    assert [s["staleness"] for s in r.per_step[1:]] == [1.0] * (len(r.per_step) - 1)
    assert r.step_time_s < _run(Mode.sync()).step_time_s


@pytest.mark.parametrize("alpha", [1, 2, 3])
def test_async_never_trains_beyond_its_bound_and_restarts_what_it_aborts(alpha: int) -> None:
    r = _run(Mode.asynchronous(alpha), steps=8)
    assert r.steps == 8 and r.staleness_max <= alpha
    assert all(s["trajectories"] == 16 for s in r.per_step)
    assert 0.0 <= r.aborted_fraction < 1.0
    assert sum(r.batch_mix.values()) == pytest.approx(1.0)


@pytest.mark.parametrize("alpha", [1, 2])
def test_updating_at_the_take_lags_the_trainer_by_one_version(alpha: int) -> None:
    """RollArt's workflow (get_batch, model_update, train_step): the bound counts on the fleet, which is one
    update behind the trainer after the first step, so data is at most alpha + 1 updates older than the
    policy trained; pushing each update as soon as it is made keeps it within alpha."""
    at_take, eager = _run(Mode.asynchronous(alpha), steps=8), _run(Mode.asynchronous(alpha, False), steps=8)
    assert at_take.staleness_max <= alpha and at_take.policy_lag_max == alpha + 1
    assert eager.staleness_max <= alpha and eager.policy_lag_max == eager.staleness_max
    assert eager.mode == f"async-{alpha}-eager"
    # The step's update sits between the take and training: a step is never shorter than training and sync.
    gaps = list(np.diff(at_take.step_ends_s))
    trains = [s["train_s"] for s in at_take.per_step[2:]]
    assert all(g >= t + at_take.sync_s - 1e-6 for g, t in zip(gaps[1:], trains, strict=False))
    # The first step has no update to push yet: it trains right after its take.
    assert at_take.step_ends_s[0] == pytest.approx(
        at_take.per_step[0]["wait_s"] + at_take.per_step[0]["train_s"]
    )


def test_runs_are_deterministic_and_reject_bad_setups() -> None:
    a, b = _run(Mode.asynchronous(1)), _run(Mode.asynchronous(1))
    assert a.step_ends_s == b.step_ends_s and a.aborted_tokens == b.aborted_tokens
    with pytest.raises(ValueError, match="warm-up"):
        run_training(_workload(), MODEL, POOLS, TRAIN, Mode.sync(), 4, steps=1, warmup=1)
    with pytest.raises(ValueError, match="fewer than a batch"):
        run_training(_workload(groups=2), MODEL, POOLS, TRAIN, Mode.sync(), 4, steps=3)
    with pytest.raises(ValueError, match="bound of at least 1"):
        Mode.asynchronous(0)


def test_affinity_keeps_each_task_on_its_gpu_type() -> None:
    both = [Pool("h800", 2, 1), Pool("h20", 2, 1)]
    everything_on_h20 = run_training(
        _workload(), MODEL, both, TRAIN, Mode.one_off(), 4, 5, warmup=1, affinity={"default": "h20"}
    )
    h20_alone = run_training(_workload(), MODEL, [Pool("h20", 2, 1)], TRAIN, Mode.one_off(), 4, 5, warmup=1)
    assert everything_on_h20.step_ends_s == pytest.approx(h20_alone.step_ends_s)
    # A GPU type no pool has is no constraint at all.
    anywhere = run_training(_workload(), MODEL, both, TRAIN, Mode.one_off(), 4, 5, warmup=1)
    absent = run_training(
        _workload(), MODEL, both, TRAIN, Mode.one_off(), 4, 5, warmup=1, affinity={"default": "b200"}
    )
    assert absent.step_ends_s == pytest.approx(anywhere.step_ends_s)


def test_cross_cluster_engines_fetch_weights_while_they_generate() -> None:
    pools = [Pool("h800", 2, 1, "rdma"), Pool("h20", 2, 1, "tcp")]
    blocking = run_training(_workload(), MODEL, pools, TRAIN, Mode.asynchronous(1), 4, 6, warmup=1)
    overlapped = run_training(
        _workload(), MODEL, pools, TRAIN, Mode.asynchronous(1).with_async_update(), 4, 6, warmup=1
    )
    # The trainer waits for the RDMA pool only; the TCP pool's transfer no longer pauses anyone.
    assert blocking.sync_s == pytest.approx(6.911, rel=0.01) and overlapped.sync_s == pytest.approx(
        5.466, rel=0.01
    )
    assert overlapped.staleness_max <= 1
    far_only = run_training(
        _workload(), MODEL, [Pool("h20", 4, 1, "tcp")], TRAIN, Mode.asynchronous(1).with_async_update(), 4, 6
    )
    assert far_only.sync_s == 0.0 and far_only.steps == 6


def test_under_bound_zero_far_pools_hold_their_work_until_their_weights_land() -> None:
    pools = [Pool("h800", 2, 1, "rdma"), Pool("h20", 2, 1, "tcp")]
    aff = {"long": "h800", "default": "h20"}
    blocking = run_training(_workload(), MODEL, pools, TRAIN, Mode.sync(), 4, 6, warmup=1, affinity=aff)
    own = run_training(
        _workload(), MODEL, pools, TRAIN, Mode.sync().with_async_update(), 4, 6, warmup=1, affinity=aff
    )
    # The near pool starts the next batch (and its long task) after its RDMA transfer, not the TCP one.
    assert own.sync_s == pytest.approx(5.466, rel=0.01) and own.staleness_max == 0
    assert own.aborted_fraction == 0.0 and own.step_time_s < blocking.step_time_s
    far_only = run_training(
        _workload(), MODEL, [Pool("h20", 4, 1, "tcp")], TRAIN, Mode.sync().with_async_update(), 4, 6
    )
    # Nothing may generate under the old weights: the whole fetch and load is in the way.
    assert far_only.sync_s == pytest.approx(6.911 + local_load_s(MODEL, Pool("h20", 4, 1, "tcp")), rel=0.01)


def test_placement_spreads_the_long_task_instead_of_stacking_it() -> None:
    # Groups of 2 in a long, short, short rotation on 6 engines: placed by count, every long group would land
    # on the same two engines, six long trajectories each; placed by each task's predicted work, two each,
    # and the wait stays near the tail floor (the slowest trajectory alone).
    rng = random.Random(5)
    w = Workload("test", "synthetic")
    for g in range(60):
        task = "long" if g % 3 == 0 else "short"
        for s in range(2):
            turns, out = (10, 2500) if task == "long" else (2, 100)
            steps = tuple(WorkStep(500 + k * (out + 100), out, rng.uniform(0.1, 0.5)) for k in range(turns))
            w.trajectories.append(WorkTraj(f"{g}#{s}", f"p{g}", s, steps, task=task))
    r = run_training(w, MODEL, [Pool("h800", 6, 1)], TRAIN, Mode.sync(), 18, 5, warmup=2)
    assert r.tail_floor_s <= r.wait_s < 1.15 * r.tail_floor_s

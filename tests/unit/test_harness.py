"""The virtual-time rollout harness: every preset runs, work is conserved, and no makespan beats the bound."""

from __future__ import annotations

import pytest

from loom.harness.bounds import critical_path, lower_bound, throughput_bound
from loom.harness.cluster import Cluster, allocate
from loom.harness.rollout import run_rollout
from loom.protocol import PRESETS, PolicySpec
from loom.workloads import coding
from loom.workloads.base import Workload, WorkStep, WorkTraj
from tests.conftest import need_shared


@pytest.fixture(scope="module")
def small() -> Workload:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    return coding(prompts=6, group_size=4, seed=3)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_completes_every_trajectory_above_the_bound(small: Workload, preset: str) -> None:
    cluster = Cluster(gpus=4, model="qwen3-8b")
    r = run_rollout(small, PRESETS[preset], cluster, predictor="oracle")
    assert r.output_tokens == sum(t.output_tokens for t in small.trajectories)
    assert all(f > 0 for f in r.finish_s)
    assert r.makespan_s >= r.lower_bound_s * (1 - 1e-9)
    assert r.makespan_over_lb >= 1.0 and sum(r.degrees) == 4


def test_rollouts_are_deterministic(small: Workload) -> None:
    cluster = Cluster(gpus=4, model="qwen3-8b")
    a = run_rollout(small, PRESETS["slime"], cluster, predictor="history", seed=1)
    b = run_rollout(small, PRESETS["slime"], cluster, predictor="history", seed=1)
    assert a.finish_s == b.finish_s and a.queueing_s == b.queueing_s


def test_one_trajectory_alone_runs_at_its_critical_path() -> None:
    steps = (WorkStep(1000, 200, 0.5), WorkStep(1700, 300, 0.0))
    w = Workload("one", "", [WorkTraj("t", "p", 0, steps)])
    cluster = Cluster(gpus=1, model="qwen3-8b")
    r = run_rollout(w, PolicySpec(preset="round_robin").resolved(), cluster)
    assert r.makespan_s == pytest.approx(critical_path(w, cluster), rel=0.05)
    assert lower_bound(w, cluster) >= throughput_bound(w, cluster)


def test_allocation_follows_the_policy() -> None:
    cluster = Cluster(gpus=16, model="qwen3-32b")
    assert allocate(PRESETS["verl"], cluster, [1000.0] * 10) == [2] * 8  # Heddle's baseline MP for 32B
    assert allocate(PolicySpec(preset="slime", fixed_mp=8).resolved(), cluster, [1.0]) == [8, 8]
    adaptive = allocate(PRESETS["heddle"], cluster, [1000.0, 50_000.0, 2000.0])
    assert sum(adaptive) == 16 and adaptive == sorted(adaptive, reverse=True)

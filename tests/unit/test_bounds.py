"""The makespan lower bound is one: no policy's simulated rollout beats it, on any workload (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.bench.harness.bounds import critical_path, lower_bound, throughput_bound, undraftable, work
from loom.bench.harness.cluster import Cluster
from loom.bench.harness.rollout import run_rollout
from loom.engine.sim.core import Speculation
from loom.protocol import PRESETS
from loom.workloads.base import Workload, WorkStep, WorkTraj


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    trajs = []
    for i in range(draw(st.integers(1, 40))):
        steps, context = [], draw(st.integers(50, 6000))
        for k in range(draw(st.integers(1, 4))):
            out = draw(st.integers(1, 3000))
            steps.append(WorkStep(context, out, draw(st.floats(0.0, 3.0)) if k < 3 else 0.0))
            context += out + draw(st.integers(0, 8000))
        trajs.append(WorkTraj(f"t{i}", f"p{i // 4}", i % 4, tuple(steps)))
    return Workload("random", "", trajs)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.sampled_from(sorted(PRESETS)),
    st.sampled_from(["qwen3-8b", "qwen3-32b"]),
    st.sampled_from([4, 16, 256]),
)
def test_no_rollout_beats_the_lower_bound(w: Workload, preset: str, model: str, max_running: int) -> None:
    # Qwen3-32B at MP 1 on an H100 holds about 20K tokens of KV: both the batch limit and the cache bind.
    cluster = Cluster(gpus=2, model=model, max_running=max_running)
    r = run_rollout(w, PRESETS[preset], cluster, predictor="oracle")
    assert r.makespan_s >= lower_bound(w, cluster) * (1 - 1e-9)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.sampled_from(sorted(PRESETS)),
    st.floats(1.0, 8.0),
    st.floats(0.0, 1.0),
)
def test_no_drafting_beats_the_undraftable_floor(
    w: Workload, preset: str, positions: float, kept: float
) -> None:
    """Drafting shortens decodes only: however many tokens a step keeps, the makespan stays above the longest
    trajectory alone on a drafting engine at those rates, and that above its prefills and tool time, which
    are under its critical path on plain engines."""
    cluster = Cluster(gpus=2, model="qwen3-8b", max_running=16)
    spec = Speculation(positions=positions, tokens_per_step=1.0 + kept * (positions - 1.0))
    r = run_rollout(w, PRESETS[preset], cluster, predictor="oracle", speculation=spec)
    floor = undraftable(w, cluster)
    assert r.makespan_s >= critical_path(w, cluster, spec) * (1 - 1e-9)
    assert critical_path(w, cluster, spec) >= floor * (1 - 1e-9)
    assert floor <= critical_path(w, cluster) * (1 + 1e-9)


def test_the_throughput_bound_counts_observations_not_prompts() -> None:
    steps = (WorkStep(1000, 3, 1.0), WorkStep(1500, 2, 0.0))
    w = work(Workload("one", "", [WorkTraj("t", "p", 0, steps)]))
    # Token 0 of each call comes from its prefill; the 497 observation tokens attend over the 1003 before.
    assert (w.decodes, w.prefill) == (3, 497)
    assert w.decode_kv == (2 * 1000 + 3) + (1 * 1500 + 1)
    assert w.attended == 497 * 1003 + 497 * 498 / 2
    longer = Workload("two", "", [WorkTraj("t", "p", 0, (WorkStep(1000, 3, 1.0), WorkStep(5000, 2, 0.0)))])
    cluster = Cluster(gpus=1, model="qwen3-8b")
    assert throughput_bound(longer, cluster) > throughput_bound(
        Workload("one", "", [WorkTraj("t", "p", 0, steps)]), cluster
    )

"""`loom plan` and `loom bench rollout` on sizes the baselines' MP does not split: a sweep in whole nodes, and
a size asked for that no baseline can run is refused before anything loads (it was a traceback)."""

from __future__ import annotations

import pytest

from loom.bench import rollout
from loom.bench.harness.cluster import Cluster, fixed_degree
from loom.bench.plan import sweep_sizes
from loom.protocol import PRESETS
from loom_cli import plan
from loom_cli.main import build_parser


def test_the_sweep_is_in_whole_nodes_around_the_size_asked() -> None:
    assert sweep_sizes(16) == [8, 16, 32]
    # 12, 25 and 50 before: Qwen3-32B's baselines (MP 2) stopped the plan at 25 GPUs.
    assert sweep_sizes(100) == [8, 24, 48, 100, 200]


def test_a_fixed_degree_that_does_not_split_the_gpus_is_refused_by_name() -> None:
    cluster = Cluster(gpus=17, model="qwen3-32b")
    assert fixed_degree(PRESETS["heddle"], cluster) is None  # annealed: an odd GPU is its problem
    with pytest.raises(ValueError, match="17 GPUs cannot all run qwen3-32b at MP 2: give a multiple of 2"):
        fixed_degree(PRESETS["verl"], cluster)


@pytest.mark.parametrize(
    ("argv", "run"),
    [
        (["plan", "--workload", "coding"], plan.run),
        (["bench", "rollout", "--workload", "coding"], rollout.run),
    ],
)
def test_a_size_no_baseline_can_run_is_refused_before_anything_loads(argv: list[str], run: object) -> None:
    args = build_parser().parse_args([*argv, "--model", "qwen3-32b", "--gpus", "17"])
    with pytest.raises(SystemExit, match="17 GPUs cannot all run qwen3-32b at MP 2"):
        run(args)  # type: ignore[operator]

"""What every trainer's importer test checks once its trainer has written a dump: the groups it read, then
``loom trace import`` writing the same trajectories and ``loom bench rollout --workload`` replaying every
step of them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from loom.data import rollout_trace as rt
from tests.e2e.conftest import LOOM

GPUS = ("--gpus", "8", "--json")


def imports_and_replays(trainer: str, dump: Path, trajectories: list[rt.Trajectory], out: Path) -> None:
    """``trajectories`` (two steps of two prompts, three samples each, read from ``dump``) are grouped by
    prompt across steps, and import and replay through the CLI."""
    groups = [t.group for t in trajectories]
    assert len(set(groups)) == 2 and groups[:6] == groups[6:]
    assert [t.sample for t in trajectories[:6]] == [0, 1, 2, 0, 1, 2]
    r = subprocess.run(
        [LOOM, "trace", "import", trainer, str(dump), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert rt.read(out) == trajectories
    bench = subprocess.run(
        [LOOM, "bench", "rollout", "--workload", str(out), "--step", "all", "--predictor", "history", *GPUS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bench.returncode == 0, bench.stderr[-2000:]
    replay = json.loads(bench.stdout.strip().splitlines()[-1])
    assert replay["file"]["step"] == [1, 2] and replay["trajectories"] == 12
    assert replay["output_tokens"] == sum(x.output_tokens for t in trajectories for x in t.turns)

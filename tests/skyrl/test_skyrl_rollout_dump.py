"""SkyRL's rollout dump read into the rollout-trace schema: the files are written by SkyRL 0.3.0's own trainer
code (``tests.skyrl.skyrl_dump``: two GRPO steps of multi-turn samples, through ``convert_to_training_input``
and ``dump_data``), then imported without SkyRL and replayed by ``loom bench rollout --workload``."""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from loom.data import importers
from loom.data import rollout_trace as rt
from tests.trace_import import imports_and_replays

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("skyrl") is None, reason="SkyRL (make install) is absent"
)
ROOT = Path(__file__).resolve().parents[2]


def test_a_skyrl_rollout_dump_imports_and_replays(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tests.skyrl.skyrl_dump", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    written = json.loads(r.stdout.strip().splitlines()[-1])
    dump = tmp_path / "dumped_data"
    assert sorted(p.name for p in dump.iterdir()) == [
        "global_step_1_training_input.pkl",
        "global_step_2_training_input.pkl",
    ]

    # The export path, as a user would pass it; the two rows SkyRL padded each batch with are not rollouts.
    trajectories = list(importers.from_skyrl(tmp_path))
    assert len(trajectories) == len(written) == 12
    for t, w in zip(trajectories, written, strict=True):
        assert t.step == w["step"]
        assert [[x.context_tokens, x.output_tokens] for x in t.turns] == w["calls"]
        assert [x.finish_reason for x in t.turns] == ["stop"] * (len(t.turns) - 1) + [None]
    # A group is a prompt's samples at one step, named by its token ids: the same at the next step.
    imports_and_replays("skyrl", dump, trajectories, tmp_path / "skyrl.jsonl")


def test_a_skyrl_dump_that_is_not_one_is_an_error_naming_it(tmp_path: Path) -> None:
    # A pickle that would run code when loaded is refused, not run.
    evil = tmp_path / "global_step_3_training_input.pkl"
    evil.write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(
        rt.TraceFormatError, match=r"global_step_3_training_input.pkl: not a SkyRL training batch: "
    ):
        list(importers.from_skyrl(tmp_path))
    evil.unlink()
    (tmp_path / "global_step_x.pkl").write_bytes(b"")
    with pytest.raises(rt.TraceFormatError, match=r"global_step_x.pkl: a SkyRL dump is named global_step_"):
        list(importers.from_skyrl(tmp_path / "global_step_x.pkl"))

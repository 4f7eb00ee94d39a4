"""slime's rollout dump read into the rollout-trace schema and replayed by ``loom bench rollout --workload``.

The dumps in ``rollouts/`` were written by slime's own ``save_debug_rollout_data`` (``tests.slime.slime_dump``,
whose docstring says why CI cannot run slime); ``written.json`` is what that script says it wrote. Where
``LOOM_SLIME_SRC`` names a slime checkout, the test has slime write them again and checks they import the same.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom.data import importers
from loom.data import rollout_trace as rt
from tests.trace_import import imports_and_replays

HERE = Path(__file__).resolve().parent
ROLLOUTS = HERE / "rollouts"


def _check(trajectories: list[rt.Trajectory], written: list[dict[str, object]]) -> None:
    assert len(trajectories) == len(written) == 12
    for t, w in zip(trajectories, written, strict=True):
        assert t.step == w["rollout"]
        assert [[x.context_tokens, x.output_tokens] for x in t.turns] == w["calls"]
        finish = {"completed": "stop", "truncated": "length"}[str(w["status"])]
        assert [x.finish_reason for x in t.turns] == ["stop"] * (len(t.turns) - 1) + [finish]
        # The tools' seconds, one figure per sample, shared among its tool calls (unknown where slime says 0).
        env = [x.env_s for x in t.turns]
        assert (sum(env) if w["env_s"] else env) == pytest.approx(w["env_s"] or [None] * len(t.turns))


def test_a_slime_rollout_dump_imports_and_replays(tmp_path: Path) -> None:
    trajectories = list(importers.from_slime(ROLLOUTS))  # eval_2.pt, an evaluation's dump, is left out
    _check(trajectories, json.loads((ROLLOUTS / "written.json").read_text()))
    assert all(t.prompt and t.prompt.startswith("<|im_start|>user") for t in trajectories)
    assert [t.turns[0].action is not None for t in trajectories] == [len(t.turns) == 1 for t in trajectories]

    imports_and_replays("slime", ROLLOUTS, trajectories, tmp_path / "slime.jsonl")


@pytest.mark.skipif(not os.environ.get("LOOM_SLIME_SRC"), reason="LOOM_SLIME_SRC names no slime checkout")
def test_slime_writes_the_same_dumps_again(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "tests.slime.slime_dump", str(tmp_path / "{rollout_id}.pt")],
        capture_output=True,
        text=True,
        cwd=HERE.parents[1],
        env={**os.environ, "PYTHONPATH": os.environ["LOOM_SLIME_SRC"]},
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == json.loads((ROLLOUTS / "written.json").read_text())
    assert list(importers.from_slime(tmp_path)) == list(importers.from_slime(ROLLOUTS))


def test_a_malformed_slime_dump_is_an_error_naming_file_and_field(tmp_path: Path) -> None:
    data = torch.load(ROLLOUTS / "1.pt", weights_only=True)
    data["samples"][4]["loss_mask"] = data["samples"][4]["loss_mask"][:-1]
    torch.save(data, tmp_path / "1.pt")
    with pytest.raises(
        rt.TraceFormatError, match=r"1.pt: sample 4: loss_mask has \d+ entries .* `\$.samples\[4\].loss_mask`"
    ):
        list(importers.from_slime(tmp_path))
    del data["samples"][2]["status"]
    torch.save(data, tmp_path / "1.pt")
    with pytest.raises(
        rt.TraceFormatError, match=r"1.pt: sample 2: a slime sample's `status` must be str, got None"
    ):
        list(importers.from_slime(tmp_path))
    shutil.copy(ROLLOUTS / "1.pt", tmp_path / "again.pt")
    (tmp_path / "1.pt").unlink()
    shutil.copy(ROLLOUTS / "1.pt", tmp_path / "1.pt")
    with pytest.raises(rt.TraceFormatError, match=r"again.pt: rollout 1 again \(first in .*/1.pt\)"):
        list(importers.from_slime(tmp_path))
    # A pickle that would run code when loaded is refused, not run.
    (tmp_path / "bad.pt").write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(rt.TraceFormatError, match=r"bad.pt: not a slime rollout dump torch can read"):
        list(importers.from_slime(tmp_path / "bad.pt"))

"""`loom train --tiny`: the whole training loop through Loom's services, as a user runs it (subprocess)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import outlive

LOOM = str(Path(sys.executable).parent / "loom")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEYS = {
    "reward_first",
    "reward_last",
    "reward_gain_ci95",
    "steps",
    "weight_versions",
    "max_staleness",
    "async_bound",
    "wall_s",
    "sync_wall_s",
    "sync_reward_last",
    "eval_prompts",
    "failed_first",
    "failed_last",
    "end_reasons_first",
    "end_reasons_last",
    "clue_consistent_first",
    "clue_consistent_last",
    "baseline_random",
    "baseline_fixed_order",
    "baseline_demonstrator",
}


def test_loom_train_tiny_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "train"
    r = subprocess.run(
        [LOOM, "train", "--tiny", "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(summary) >= KEYS, summary
    assert summary["steps"] == 2 and summary["weight_versions"] == 3
    assert summary["async_bound"] == 1 and 0 <= summary["max_staleness"] <= 1
    assert summary["eval_tasks"] == 8 and 0.0 <= summary["reward_first"] <= 1.0
    lo, hi = summary["reward_gain_ci95"]
    assert lo <= summary["reward_gain"] <= hi
    assert summary["wall_s"] > 0 and summary["sync_wall_s"] > 0
    # Baselines of the same held-out games: random distinct boxes find the coin tries / boxes of the time.
    assert 0.4 < summary["baseline_random"] < 0.5 and summary["eval_prompts"] <= summary["eval_tasks"]
    assert sum(summary["end_reasons_first"].values()) + summary["failed_first"] == 8
    # Each update went by broadcast (loom.weights), received inside the pause: nothing fetched meanwhile.
    assert summary["weights_transport"] == "collective"
    assert summary["update_fetch_s"] == 0 and summary["update_pause_s"] > 0
    report = json.loads((out / "train.json").read_text())
    modes = {m["async_bound"]: m for m in report["modes"]}
    assert set(modes) == {0, 1}
    for alpha, m in modes.items():
        assert [s["step"] for s in m["steps"]] == [1, 2]
        assert all(s["staleness_max"] <= alpha and s["trained"] + s["skipped"] == 8 for s in m["steps"])
    # No checkpoint per step (the start's alone), and the plot was drawn.
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("config.json")) == ["ckpt/v0/config.json"]
    assert (out / "train.png").stat().st_size > 10_000


def test_sigterm_stops_loom_train_and_everything_it_started(tmp_path: Path) -> None:
    """`timeout` and job schedulers send SIGTERM: `loom train` stops its services and nats-server as Ctrl-C
    does, and exits (they used to run on for 40 minutes, orphaned)."""
    out = tmp_path / "train"
    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [LOOM, "train", "--tiny", "--out", str(out)], stdout=f, stderr=subprocess.STDOUT
        )
    state = out / "alpha1" / "loom" / "state.json"
    deadline = time.monotonic() + 300
    while b"held-out reward before" not in log.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    s = json.loads(state.read_text())
    pids = [*s["pids"].values(), *s["nats_pids"]]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) != 0  # interrupted, not finished
    assert outlive(pids, 25) == [], log.read_text()[-3000:]
    assert not (out / "alpha0").exists()  # it did not go on to the next mode


def test_loom_train_quick_learns(tmp_path: Path) -> None:
    """The guard on what `loom train` is for: through every service, the quick preset's policy gains on the
    held-out games (interval over prompts above 0) and plays the clue better than it did. Without it, 44 commits
    once went by with the gain at 0 and nobody saw it. About five minutes: one run, at async_bound 0, whose
    samples do not depend on how the trainer's and the engine's timings interleave."""
    out = tmp_path / "train"
    r = subprocess.run(
        # All 300 held-out games (the preset scores 200): a narrower interval, so that a healthy run's gain
        # (about +0.1) clears 0 with room to spare.
        [LOOM, "train", "--quick", "--async-bound", "0", "--eval-tasks", "300", "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(s))  # the figures, in the test log, whichever way it goes
    assert s["eval_tasks"] == 300 and s["failed_first"] == s["failed_last"] == 0
    assert s["eval_prompts"] >= 200  # the interval resamples prompts, not games of one prompt
    assert s["reward_gain_ci95"][0] > 0, s
    assert s["clue_consistent_last"] > s["clue_consistent_first"], s
    # A policy that learns through Loom beats chance: distinct boxes opened at random.
    assert s["reward_last"] > s["baseline_random"], s
    assert s["end_reasons_last"].get("no box number", 0) < s["end_reasons_first"]["no box number"], s
    assert abs(s["is_weight_mean_sync"] - 1) <= 0.01, s  # the engine and the trainer agree on log-probs
    # Moved by broadcast, no checkpoint per step: after each update the fleet's log-probs of the tokens it
    # made equal the trainer's for the same weights within 0.02 (the largest gap of any token of any step).
    assert s["weights_transport"] == "collective" and s["logprob_max_abs_diff_sync"] <= 0.02, s
    assert [p for p in out.rglob("config.json") if p.parent.name != "v0"] == []

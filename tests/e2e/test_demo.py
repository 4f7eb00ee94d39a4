from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import need_shared
from tests.e2e.conftest import LOOM


def test_demo_runs_end_to_end_and_prints_one_json_line(tmp_path: Path) -> None:
    """Told to, the demo first trains a length predictor where none exists (a few seconds' worth here), and
    the predictor service serves it: its health names the learned method, not the history fallback."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    small = ["--prompts", "2", "--samples", "2", "--workers", "2", "--speed", "100"]
    r = subprocess.run(
        [LOOM, "demo", *small, "--predictor-steps", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "LOOM_HOME": str(tmp_path)},  # the model goes there, not where other tests look
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["trajectories"] == line["completed"] == 4 and line["failed"] == 0
    assert line["makespan_s"] > 0 and line["throughput_tok_s"] > 0
    assert 0 < line["step_latency_ms"]["p50"] <= line["step_latency_ms"]["p99"]
    assert line["predictor"] == "progressive"

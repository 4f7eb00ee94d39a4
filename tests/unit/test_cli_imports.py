"""Every `loom` command starts by importing the CLI, benchmarks included: it must not pull in torch or
transformers (seconds each), or `loom cancel` and its kind take seconds to run. The HA and vLLM e2e tests
cancel a job mid-flight through the CLI, and failed when a benchmark imported torch at module level."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_starts_without_torch_or_transformers() -> None:
    probe = (
        "import sys, loom_cli.main, loom_cli.bench; "
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert r.stdout.strip() == "", f"imported at CLI start: {r.stdout.strip()}"

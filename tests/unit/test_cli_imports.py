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


def test_every_service_starts_without_torch() -> None:
    """The services' container images leave torch out (loom.sandbox.stack_images: TRAINING_ONLY): a service that
    imports it at start, even through the simulated engine or servers, does not start there (a rollout worker
    did, once the simulated engine took broadcast weights)."""
    mains = ", ".join(
        f"services.{s}.__main__" for s in ("scheduler", "router", "rollout", "predictor", "envmgr", "reward")
    )
    probe = (
        f"import sys, {mains}, loom.engine.fakes.sglang_server, loom.engine.fakes.vllm_server, loom.engine.sim.engine; "
        "from loom.engine import kinds; [kinds.KINDS[k] for k in kinds.KINDS]; "
        "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert r.stdout.strip() == "", f"imported at service start: {r.stdout.strip()}"

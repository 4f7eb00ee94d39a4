"""``verifiers:<id>`` (loom.envs.adapters.verifiers) at submission: an environment's tasks are its dataset's rows,
and what cannot be served is refused with the field to blame: verifiers missing, a module not allowed or not
installed, arguments the environment refuses."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from loom.envs.adapters import gem
from loom.protocol import DatasetRef, JobSpec
from services.scheduler.tasks import SpecError, resolve_tasks

ROOT = Path(__file__).resolve().parents[2]


def _refused(spec: JobSpec) -> SpecError:
    with pytest.raises(SpecError) as e:
        resolve_tasks(spec, None)
    return e.value


def test_the_tasks_are_the_dataset_s_rows() -> None:
    pytest.importorskip("verifiers")
    tasks = resolve_tasks(JobSpec(env="verifiers:vf-calc", env_params={"n": 3}, dataset=DatasetRef()), None)
    assert [t.id for t in tasks] == ["0", "1", "2"]
    assert tasks[1].data["prompt"] == "What is 3 times 4?" and tasks[1].data["params"] == {"n": 3}


def test_what_cannot_be_served_is_refused_naming_the_field() -> None:
    pytest.importorskip("verifiers")
    e = _refused(JobSpec(env="verifiers:json", dataset=DatasetRef()))  # importable, but not the operator's
    assert e.loc == ["env"] and "allowlist" in e.msg
    e = _refused(JobSpec(env="verifiers:vf-missing", dataset=DatasetRef()))  # allowed, not installed
    assert e.loc == ["env"] and "no verifiers environment 'vf-missing'" in e.msg
    e = _refused(JobSpec(env="verifiers:vf-calc", env_params={"bogus": 1}, dataset=DatasetRef()))
    assert e.loc == ["env_params"] and "bogus" in e.msg
    e = _refused(JobSpec(env="verifiers:vf-calc", dataset=DatasetRef(), scripted=True))
    assert e.loc == ["scripted"] and "no reference replies" in e.msg


def test_without_verifiers_installed_a_job_naming_one_is_refused() -> None:
    """In an environment without verifiers (the GEM virtualenv: Loom and no extras), the scheduler's own check."""
    python = gem.default_python()
    if python is None:
        pytest.skip("no virtualenv without verifiers (.venv-gem): `make install` builds it")
    code = (
        "from loom.protocol import DatasetRef, JobSpec; from services.scheduler.tasks import resolve_tasks\n"
        "try:\n resolve_tasks(JobSpec(env='verifiers:vf-calc', dataset=DatasetRef()), None)\n"
        "except Exception as e:\n print(type(e).__name__, e.loc, e)"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}"}
    out = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    assert out.stdout.startswith("SpecError ['env']"), out.stdout + out.stderr
    assert "pip install 'loom[verifiers]'" in out.stdout


def test_loading_an_environment_leaves_the_service_s_signal_handlers() -> None:
    """A verifiers Environment takes SIGINT and SIGTERM as it is built; the service's own (which drain it) stay."""
    pytest.importorskip("verifiers")
    from loom.envs.adapters import verifiers as adapter

    def handlers() -> dict[int, object]:
        return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    before = handlers()
    adapter.load("vf-calc", {"n": 5, "max_turns": 2})  # arguments no other test loads with: built here
    assert handlers() == before

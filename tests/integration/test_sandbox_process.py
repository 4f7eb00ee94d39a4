"""The process fallback: the same containment checks, with rlimits and a network namespace instead of cgroups."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loom.sandbox import Limits
from loom.sandbox.pool import SandboxPool
from loom.sandbox.process_backend import ProcessBackend, _isolation

LIMITS = Limits(memory_mb=256, pids=32, timeout_s=10.0)


@pytest.fixture
async def pool() -> AsyncIterator[SandboxPool]:
    # Not under pytest's tmp_path: its 0700 parents would keep the unprivileged sandbox user out.
    base = Path(tempfile.gettempdir()) / f"loom-sbx-test-{uuid.uuid4().hex[:8]}"
    p = SandboxPool(ProcessBackend(base), LIMITS, warm=1, max_sandboxes=4)
    await p.start()
    try:
        yield p
    finally:
        await p.close()
    assert not any(base.iterdir())  # every work directory is gone
    base.rmdir()


async def test_runs_files_and_kills_at_timeout(pool: SandboxPool) -> None:
    async with pool.session("a") as sb:
        await sb.write_files({"pkg/m.py": "print(6 * 7)\n"})
        assert (await sb.exec(["python3", "pkg/m.py"])).stdout == "42\n"
        r = await sb.exec(["python3", "-c", "while True: pass"], timeout_s=1.0)
        assert r.timed_out and r.exit_code == 124 and r.duration_s < 3


async def test_memory_and_processes_are_limited(pool: SandboxPool) -> None:
    async with pool.session("b") as sb:
        hog = await sb.exec(["python3", "-c", "x = bytearray(1024 ** 3)"])
        assert hog.exit_code == 1 and "MemoryError" in hog.stderr
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        r = await sb.exec(["python3", "-c", bomb], timeout_s=2)
        assert r.timed_out
        assert (await sb.exec(["python3", "-c", "pass"])).ok


async def test_no_network_where_a_namespace_can_be_made(pool: SandboxPool) -> None:
    if not _isolation():
        pytest.skip("this host cannot make a network namespace")
    async with pool.session("c") as sb:
        r = await sb.exec(["python3", "-c", "import socket; socket.create_connection(('10.0.0.1', 80), 3)"])
        assert r.exit_code == 1 and "unreachable" in r.stderr


async def test_paths_outside_the_work_directory_are_refused(pool: SandboxPool) -> None:
    from loom.sandbox import SandboxError

    async with pool.session("d") as sb:
        with pytest.raises(SandboxError):
            await sb.write_files({"../escape.txt": "x"})

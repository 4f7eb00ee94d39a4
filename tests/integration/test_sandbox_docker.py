"""Docker sandboxes against a real engine: HumanEval in the sandbox, and the limits that contain bad code."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest

from loom.envs import tasksets
from loom.sandbox import Limits
from loom.sandbox.docker_backend import DockerBackend
from loom.sandbox.pool import SandboxPool
from tests.conftest import need_shared

# The first test may build the image (debootstrap: about 2 minutes on a fresh machine).
pytestmark = pytest.mark.timeout(900)

LIMITS = Limits(cpus=1.0, memory_mb=256, pids=64, timeout_s=10.0)


@pytest.fixture
async def pool(sandbox_image: str) -> AsyncIterator[SandboxPool]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    backend = DockerBackend(sandbox_image, pool=name)
    p = SandboxPool(backend, LIMITS, warm=2, max_sandboxes=16)
    await p.start()
    try:
        yield p
    finally:
        await p.close()
        await backend.close()
        # Nothing the pool made survives it.
        check = DockerBackend(sandbox_image, pool=name)
        try:
            assert await check.count() == 0
        finally:
            await check.close()


async def _run(pool: SandboxPool, key: str, program: str, timeout_s: float = 10.0) -> tuple[int, str]:
    async with pool.session(key) as sb:
        await sb.write_files({"main.py": program})
        r = await sb.exec(["python3", "main.py"], timeout_s=timeout_s)
        return r.exit_code, r.stderr


async def test_every_humaneval_canonical_solution_passes_and_a_wrong_one_fails(pool: SandboxPool) -> None:
    need_shared("data/tasks/HumanEval.jsonl.gz")
    tasks = list(tasksets.humaneval().values())
    assert len(tasks) == 164

    # Eight sandboxes, each running its share of the programs one process at a time (a container start
    # costs ~0.7 s on the vfs storage driver; an exec ~0.08 s).
    async def shard(i: int) -> list[tuple[str, int, str]]:
        out = []
        async with pool.session(f"humaneval-{i}") as sb:
            for t in tasks[i::8]:
                assert t.reference is not None
                name = t.id.replace("/", "_") + ".py"
                await sb.write_files({name: t.program(t.reference)})
                r = await sb.exec(["python3", name])
                out.append((t.id, r.exit_code, r.stderr))
        return out

    results = [r for rs in await asyncio.gather(*(shard(i) for i in range(8))) for r in rs]
    assert len(results) == 164
    failed = [(i, err[-300:]) for i, code, err in results if code != 0]
    assert not failed, failed
    wrong = tasks[0].program("    return not True\n")
    code, err = await _run(pool, "wrong", wrong)
    assert code == 1 and "AssertionError" in err


async def test_infinite_loop_is_killed_at_its_timeout(pool: SandboxPool) -> None:
    async with pool.session("loop") as sb:
        r = await sb.exec(["python3", "-c", "while True: pass"], timeout_s=1.5)
        assert r.timed_out and r.exit_code == 124
        assert 1.5 <= r.duration_s < 4.0
        # The sandbox is still usable afterwards.
        assert (await sb.exec(["python3", "-c", "print(6 * 7)"])).stdout == "42\n"


async def test_a_process_that_escapes_the_timeout_takes_the_sandbox_with_it(pool: SandboxPool) -> None:
    """Commands run through the sandbox's resident agent; one that leaves a process outside its group
    holding its output cannot be cleaned up, so the sandbox goes."""
    async with pool.session("escape") as sb:
        r = await sb.exec(["sh", "-c", "setsid sleep 600 & echo started"], timeout_s=1.0)
        assert r.timed_out and r.stdout == "started\n"
        assert sb.closed


async def test_an_agent_that_dies_is_a_sandbox_error(pool: SandboxPool) -> None:
    from loom.sandbox import SandboxError

    async with pool.session("agent") as sb:
        r = await sb.exec(["sh", "-c", "echo $GREETING; exit 3"], env={"GREETING": "hello"})
        assert r.exit_code == 3 and r.stdout == "hello\n"
        assert (await sb.exec(["no-such-command"])).exit_code == 127
        # The agent is the command's parent: killing it loses the command's answer, and the sandbox.
        with pytest.raises(SandboxError, match="agent exited"):
            await sb.exec(["sh", "-c", "kill -9 $PPID; sleep 5"])
        assert sb.closed


async def test_fork_bomb_is_contained_by_the_pid_limit(pool: SandboxPool) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    async with pool.session("bomb") as sb:
        r = await sb.exec(["python3", "-c", bomb], timeout_s=3)
        assert r.timed_out
        after = await sb.exec(["sh", "-c", "ls /proc | grep -c '^[0-9]'"])
        assert after.ok and int(after.stdout) < 10  # the bomb's processes died with it
    # Other sandboxes were never short of processes.
    async with pool.session("neighbour") as sb:
        assert (await sb.exec(["python3", "-c", "pass"])).ok


async def test_memory_hog_is_killed_at_the_memory_limit(pool: SandboxPool) -> None:
    async with pool.session("hog") as sb:
        r = await sb.exec(["python3", "-c", "x = bytearray(1024 ** 3); print(len(x))"])
        assert not r.ok and not r.timed_out
        assert r.exit_code in (137, 1)  # OOM-killed, or MemoryError raised
        assert "1073741824" not in r.stdout


async def test_no_network_read_only_root_and_unprivileged_user(pool: SandboxPool) -> None:
    async with pool.session("net") as sb:
        net = await sb.exec(
            ["python3", "-c", "import socket; socket.create_connection(('10.0.0.1', 80), timeout=3)"]
        )
        assert net.exit_code == 1 and ("unreachable" in net.stderr or "OSError" in net.stderr)
        ro = await sb.exec(["sh", "-c", "touch /usr/x"])
        assert ro.exit_code != 0 and "Read-only" in ro.stderr
        who = await sb.exec(["id", "-u"])
        assert who.stdout.strip() == "10001"


async def test_output_is_capped_without_blocking_the_command(pool: SandboxPool) -> None:
    async with pool.session("spam") as sb:
        r = await sb.exec(["python3", "-c", "import sys; sys.stdout.write('y' * 10_000_000)"])
        assert r.ok and r.truncated and len(r.stdout) == LIMITS.output_bytes


async def test_session_affinity_and_isolation(pool: SandboxPool) -> None:
    a = await pool.acquire("a")
    assert await pool.acquire("a") is a
    await a.write_files({"state.txt": "kept"})
    assert (await a.exec(["cat", "state.txt"])).stdout == "kept"
    b = await pool.acquire("b")
    assert b.id != a.id and not (await b.exec(["cat", "state.txt"])).ok
    await pool.release("a")
    await pool.release("b")


async def test_reaper_removes_sandboxes_whose_owner_died(sandbox_image: str) -> None:
    backend = DockerBackend(sandbox_image, pool=f"orphans-{uuid.uuid4().hex[:8]}")
    try:
        sb = await backend.create(LIMITS)
        assert await backend.count() == 1
        # A sandbox whose owner crashed: same host, a pid that is not running.
        cfg = backend.config(LIMITS)
        cfg["Labels"]["loom.owner"] = f"{socket.gethostname()}/999999/0"
        orphan = await backend.docker.containers.run(cfg, name="loom-sbx-orphan-test")
        assert await backend.count() == 2
        assert await backend.reap() == 1
        assert await backend.count() == 1
        assert orphan.id not in {c.id for c in await backend.docker.containers.list(all=True)}
        await sb.close()
    finally:
        await backend.close()

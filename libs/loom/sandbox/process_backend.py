"""The fallback when no Docker engine answers: a process per command, in a private directory, with rlimits.

Weaker than a container and said so: no read-only root and no cgroup. Memory is capped by the address
space, processes by RLIMIT_NPROC under an unprivileged uid (when started as root), the network by a
fresh network namespace where ``unshare`` may make one, and a command's whole process group dies at its
timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from loom.sandbox.types import CappedOutput, ExecResult, Limits, SandboxError

log = logging.getLogger(__name__)

NOBODY = 65534


@functools.cache
def _isolation() -> tuple[str, ...]:
    """The command prefix that drops the network (and, as root, privileges), as far as this host allows."""
    root = os.geteuid() == 0
    if shutil.which("unshare"):
        prefix = (
            ("unshare", "--net", "--setuid", str(NOBODY), "--setgid", str(NOBODY), "--")
            if root
            else ("unshare", "--map-root-user", "--net", "--")
        )
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    log.warning("SANDBOX FALLBACK: cannot make a network namespace here; process sandboxes have network")
    return ()


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> CappedOutput:
    out = CappedOutput(cap)
    while chunk := await stream.read(65536):
        out.add(chunk)
    return out


class ProcessSandbox:
    backend = "process"

    def __init__(self, root: Path, limits: Limits) -> None:
        self.root = root
        self.limits = limits
        self.id = root.name
        self.closed = False

    def _preexec(self, timeout_s: float) -> None:
        mem = self.limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_NPROC, (self.limits.pids, self.limits.pids))
        cpu = int(timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        fsize = self.limits.work_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    async def exec(
        self, cmd: list[str], *, timeout_s: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        t = self.limits.timeout_s if timeout_s is None else timeout_s
        base = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.root),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *_isolation(),
                *cmd,
                cwd=self.root,
                env=base | (env or {}),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=functools.partial(self._preexec, t),
            )
        except OSError as e:
            return ExecResult(127, "", f"{cmd[0]}: {e}", time.monotonic() - t0)
        assert proc.stdout is not None and proc.stderr is not None
        reads = asyncio.gather(
            _read_capped(proc.stdout, self.limits.output_bytes),
            _read_capped(proc.stderr, self.limits.output_bytes),
        )
        timed_out = False
        try:
            async with asyncio.timeout(t):
                await proc.wait()
        except TimeoutError:
            timed_out = True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the command's children too
            await proc.wait()
        out, err = await reads
        rc = proc.returncode or 0
        # A command killed by a signal reads as 128 + signal, as a shell (and Docker) report it.
        code = rc if rc >= 0 else 128 - rc
        return CappedOutput.result(code, out, err, time.monotonic() - t0, timed_out)

    async def write_files(self, files: dict[str, bytes | str]) -> None:
        for rel, data in files.items():
            p = (self.root / rel).resolve()
            if not p.is_relative_to(self.root.resolve()):
                raise SandboxError(f"bad path: {rel}")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data.encode() if isinstance(data, str) else data)
            if os.geteuid() == 0:
                os.chown(p, NOBODY, NOBODY)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            shutil.rmtree(self.root, ignore_errors=True)


class ProcessBackend:
    name = "process"

    def __init__(self, base: Path | None = None) -> None:
        self.base = base or Path(tempfile.gettempdir()) / "loom-sandboxes"
        self.base.mkdir(parents=True, exist_ok=True)
        self.base.chmod(0o711)  # the unprivileged sandbox user must reach its own directory

    async def check(self) -> None:
        _isolation()

    async def create(self, limits: Limits) -> ProcessSandbox:
        root = self.base / f"sbx-{uuid.uuid4().hex[:12]}"
        root.mkdir(mode=0o700)
        if os.geteuid() == 0:
            os.chown(root, NOBODY, NOBODY)
        return ProcessSandbox(root, limits)

    async def reap(self) -> int:
        return 0

    async def close(self) -> None:
        pass

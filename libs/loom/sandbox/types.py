"""What every sandbox backend offers: files in a work directory and commands with limits."""

from __future__ import annotations

from typing import Protocol

from msgspec import Struct

# Exit status a command gets when its wall-clock timeout killed it (the convention of GNU timeout).
TIMEOUT_EXIT = 124
WORKDIR = "/work"


class Limits(Struct, frozen=True, forbid_unknown_fields=True):
    """Per-sandbox resource limits. A command's timeout is per call; the rest hold for the sandbox's life."""

    cpus: float = 1.0
    memory_mb: int = 512
    pids: int = 128
    # Size of the writable work directory (a tmpfs in Docker).
    work_mb: int = 64
    # Output kept per stream of one command; the rest is read and dropped so the command never blocks.
    output_bytes: int = 64 * 1024
    timeout_s: float = 10.0


class ExecResult(Struct, frozen=True):
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class CappedOutput:
    """One stream of a command's output: the first ``cap`` bytes kept, the rest counted as dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.truncated = False

    def add(self, data: bytes) -> None:
        room = self.cap - len(self.buf)
        if len(data) > room:
            self.truncated = True
        if room > 0:
            self.buf.extend(data[:room])

    def text(self) -> str:
        return self.buf.decode(errors="replace")

    @staticmethod
    def result(
        code: int, out: CappedOutput, err: CappedOutput, duration_s: float, timed_out: bool
    ) -> ExecResult:
        """The command's result from its two captured streams."""
        return ExecResult(
            TIMEOUT_EXIT if timed_out else code,
            out.text(),
            err.text(),
            duration_s,
            timed_out=timed_out,
            truncated=out.truncated or err.truncated,
        )


class SandboxError(Exception):
    """The sandbox itself failed (engine error, container gone): the environment, not the command."""


class SandboxUnavailable(SandboxError):
    """No backend can run sandboxes here."""


class Sandbox(Protocol):
    id: str
    backend: str

    async def exec(
        self,
        cmd: list[str],
        *,
        timeout_s: float | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...

    async def write_files(self, files: dict[str, bytes | str]) -> None:
        """Write files under the work directory (paths relative to it)."""
        ...

    async def close(self) -> None: ...

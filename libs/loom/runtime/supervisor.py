"""Runs service processes and restarts them with backoff when they die (the embedded deployment)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loom.runtime.lifecycle import dies_with_me

log = logging.getLogger(__name__)


@dataclass
class ProcSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class _Proc:
    spec: ProcSpec
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    task: asyncio.Task[None] | None = None


class Supervisor:
    """One watcher task per process: when a process exits while the supervisor runs, it is started
    again after a backoff that doubles per quick crash (0.25 s up to 10 s) and resets after 30 s up."""

    def __init__(self, log_dir: Path, on_change: Callable[[], None] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.procs: dict[str, _Proc] = {}
        self.stopping = False
        self.on_change = on_change

    def pids(self) -> dict[str, int]:
        return {
            n: p.proc.pid for n, p in self.procs.items() if p.proc is not None and p.proc.returncode is None
        }

    def restarts(self) -> dict[str, int]:
        return {n: p.restarts for n, p in self.procs.items()}

    async def start(self, spec: ProcSpec) -> None:
        p = self.procs[spec.name] = _Proc(spec)
        await self._spawn(p)
        p.task = asyncio.create_task(self._watch(p), name=f"watch-{spec.name}")

    async def _spawn(self, p: _Proc) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{p.spec.name}.log", "ab")  # noqa: SIM115, ASYNC230 - once, at spawn
        p.proc = await asyncio.create_subprocess_exec(
            *p.spec.argv,
            env={**os.environ, **p.spec.env},
            stdout=out,
            stderr=out,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches the supervisor only; it stops the children in order
            preexec_fn=dies_with_me(),  # and a supervisor that dies otherwise takes them with it
        )
        out.close()
        p.started_at = time.monotonic()
        if self.on_change:
            self.on_change()

    async def _watch(self, p: _Proc) -> None:
        backoff = 0.25
        while True:
            assert p.proc is not None
            rc = await p.proc.wait()
            if self.stopping:
                return
            up = time.monotonic() - p.started_at
            backoff = 0.25 if up > 30 else min(backoff * 2, 10.0)
            log.warning("%s exited with %s after %.1f s; restarting in %.2f s", p.spec.name, rc, up, backoff)
            await asyncio.sleep(backoff)
            if self.stopping:
                return
            p.restarts += 1
            await self._spawn(p)

    async def stop(self, grace: float = 15.0) -> None:
        """SIGTERM everything (services drain), then SIGKILL what is left after ``grace`` seconds."""
        self.stopping = True
        for p in self.procs.values():
            if p.task is not None:
                p.task.cancel()
            if p.proc is not None and p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGTERM)
        waits = [p.proc.wait() for p in self.procs.values() if p.proc is not None]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), grace)
        except TimeoutError:
            for p in self.procs.values():
                if p.proc is not None and p.proc.returncode is None:
                    log.warning("%s did not stop in %.0f s; killing it", p.spec.name, grace)
                    with contextlib.suppress(ProcessLookupError):
                        p.proc.kill()
            await asyncio.gather(*(p.proc.wait() for p in self.procs.values() if p.proc is not None))
        for p in self.procs.values():
            if p.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await p.task

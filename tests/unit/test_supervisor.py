from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from loom.runtime.supervisor import ProcSpec, Supervisor


async def test_killed_process_is_restarted_and_stop_ends_all(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    await sup.start(ProcSpec("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"]))
    pid = sup.pids()["sleeper"]
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        await asyncio.sleep(0.05)
        new = sup.pids().get("sleeper")
        if new and new != pid:
            break
    assert sup.restarts()["sleeper"] == 1
    new_pid = sup.pids()["sleeper"]
    await sup.stop(grace=5)
    assert sup.pids() == {}
    try:
        os.kill(new_pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


async def test_process_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    sup = Supervisor(tmp_path)
    await sup.start(ProcSpec("stubborn", [sys.executable, "-c", code]))
    for _ in range(100):
        if "up" in (tmp_path / "stubborn.log").read_text():
            break
        await asyncio.sleep(0.05)
    await sup.stop(grace=0.5)
    assert sup.pids() == {}

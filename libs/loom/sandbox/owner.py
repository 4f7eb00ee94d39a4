"""Who owns a sandbox: host, pid and the process's start time, so a reused pid is not mistaken for it."""

from __future__ import annotations

import os
import socket


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # Field 22 (starttime); the command name in field 2 may hold spaces, so split after its ')'.
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def token() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{_start_ticks(pid) or 0}"


def alive(tok: str) -> bool:
    """False only when the owner ran on this host and is gone; another host's owners are judged by expiry."""
    try:
        host, pid, ticks = tok.split("/")
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    return _start_ticks(int(pid)) == ticks

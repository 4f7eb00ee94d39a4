"""Hosts for tests: network namespaces of this machine, each with its own address, reaching the root namespace
(where NATS listens, at ``CONTROL``: its end of the first host's veth pair, local to it) over a veth pair. Processes run in a host with ``ip netns exec``;
killing a host kills every process in it, as losing a machine does."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROL = "10.77.1.1"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def missing() -> str | None:
    """Why hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    return None


@dataclass
class Host:
    name: str
    address: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.name, *argv], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs.append(p)
        return p

    def pids(self) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        return [int(p) for p in r.stdout.split()]

    def kill(self) -> int:
        """SIGKILL every process in the host; how many there were."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(10)
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(pids)


class Hosts:
    """``n`` hosts named ``<tag>h<i>`` at 10.77.<i>.2, the root namespace at 10.77.<i>.1 on each link."""

    def __init__(self, n: int, tag: str | None = None) -> None:
        self.tag = tag or f"l{os.getpid() % 100000}"
        self.hosts: list[Host] = []
        try:
            # Hosts reach each other through the root namespace (a standby scheduler forwards to the active).
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
            for i in range(1, n + 1):
                self.hosts.append(self._make(i))
        except BaseException:
            self.close()
            raise

    def _make(self, i: int) -> Host:
        name, outer, inner = f"{self.tag}h{i}", f"{self.tag}v{i}", f"{self.tag}p{i}"
        _ip("netns", "add", name)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", name)
        _ip("addr", "add", f"10.77.{i}.1/24", "dev", outer)
        _ip("link", "set", outer, "up")
        for args in (
            ("addr", "add", f"10.77.{i}.2/24", "dev", inner),
            ("link", "set", inner, "up"),
            ("link", "set", "lo", "up"),
            ("route", "add", "default", "via", f"10.77.{i}.1"),
        ):
            _ip("netns", "exec", name, "ip", *args)
        return Host(name, f"10.77.{i}.2")

    def close(self) -> None:
        for h in self.hosts:
            h.kill()
            subprocess.run(["ip", "netns", "del", h.name], capture_output=True, check=False)
        for i in range(1, len(self.hosts) + 1):
            subprocess.run(["ip", "link", "del", f"{self.tag}v{i}"], capture_output=True, check=False)

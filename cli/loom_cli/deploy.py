"""The embedded deployment: a private nats-server and every service as a supervised subprocess."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loom.engine import kinds as engine_kinds
from loom.envs.adapters import gem
from loom.identity import nats_auth
from loom.identity.auth import AuthConfigError, Tokens, home_token
from loom.protocol import Health
from loom.runtime.healthcheck import gather
from loom.runtime.lifecycle import free_port
from loom.runtime.natsserver import NatsCluster, NatsServer
from loom.runtime.supervisor import ProcSpec, Supervisor

log = logging.getLogger(__name__)

STATE_FILE = "state.json"


class DeployError(RuntimeError):
    """A deployment that cannot start, with the reason."""


def default_home() -> Path:
    return Path(os.environ.get("LOOM_HOME", ".loom"))


def api_token(home: Path, create: bool = False) -> str:
    """The admin token the CLI presents: ``LOOM_API_TOKEN``, else the one ``loom up`` keeps in its home."""
    token = os.environ.get("LOOM_API_TOKEN") or home_token(home, create)
    if not token:
        raise SystemExit(f"no API token: set LOOM_API_TOKEN or start Loom with `loom up` ({home} has none)")
    return token


@dataclass
class DeployConfig:
    home: Path
    workers: int = 4
    speed: float = 1.0
    api_port: int = 8080
    nats_port: int = 0
    model: str = "qwen3-8b"
    gpu: str = "h100"
    tp: int = 1
    log_level: str = "INFO"
    # Rollout engine kind (loom.engine.kinds): one that serves a checkpoint reads ``model_path``, one that drives
    # servers takes ``engine_urls``, one per worker in turn.
    engine: str = "sim"
    model_path: str | None = None
    engine_urls: list[str] = field(default_factory=list)
    # NATS: one private nats-server (0), or a cluster of this many (3 or more) with every stream replicated.
    nats_cluster: int = 0
    # Instances of the scheduler and the router: one acts (the lease), the others stand by to take over.
    schedulers: int = 1
    routers: int = 1
    # Extra environment for every service (e.g. the data directories a training run reads).
    extra_env: dict[str, str] = field(default_factory=dict)
    # The REST API's admin token: LOOM_API_TOKEN, else the one kept under ``home`` (made on first start).
    api_token: str | None = None
    # GEM's interpreter (its own virtualenv, loom.envs.adapters.gem): an environment manager is started from
    # it that serves GEM's work lane alone, and the scheduler asks it what GEM registers. None: no GEM.
    gem_python: str | None = None


class Deployment:
    def __init__(self, cfg: DeployConfig) -> None:
        self.cfg = cfg
        # Every service, the trainer and the operator connect as their own NATS user; no one else can.
        self.passwords = nats_auth.passwords(cfg.home / "nats")
        users = nats_auth.authorization(self.passwords)
        self.nats: NatsServer | NatsCluster = (
            NatsCluster(cfg.home / "nats-cluster", cfg.nats_cluster, authorization=users)
            if cfg.nats_cluster
            else NatsServer(cfg.home / "nats", port=cfg.nats_port, authorization=users)
        )
        self.sup = Supervisor(cfg.home / "logs", on_change=self._write_state)
        self.api_url = f"http://127.0.0.1:{cfg.api_port}"
        # The standby schedulers' ports, chosen once NATS is up (its ports taken) so that none collides.
        self.standby_ports: list[int] = []
        self.api_token = cfg.api_token or api_token(cfg.home, create=True)
        self.epoch = time.time()

    def service_specs(self) -> list[ProcSpec]:
        common = {
            "LOOM_NATS_URL": self.nats.url,
            "LOOM_SPEED": repr(self.cfg.speed),
            "LOOM_CLOCK_EPOCH": repr(self.epoch),
            "LOOM_LOG_LEVEL": self.cfg.log_level,
            "PYTHONUNBUFFERED": "1",
            "LOOM_JS_REPLICAS": "3" if self.cfg.nats_cluster else "1",
            # Empty when there is no GEM: the scheduler then refuses its jobs rather than look for one.
            gem.PYTHON_ENV: self.cfg.gem_python or "",
            **self.cfg.extra_env,
        }

        def env(role: str, more: dict[str, str] | None = None) -> dict[str, str]:
            return {**common, **nats_auth.role_env(role, self.passwords[role]), **(more or {})}

        py = [sys.executable, "-m"]
        specs = [
            ProcSpec(
                replica("scheduler", i),
                [*py, "services.scheduler"],
                env(
                    "scheduler",
                    {"LOOM_SCHEDULER_PORT": str(port), "LOOM_API_TOKEN": self.api_token},
                ),
            )
            for i, port in enumerate([self.cfg.api_port, *self.standby_ports])
        ]
        specs += [
            ProcSpec(replica("router", i), [*py, "services.router"], env("router"))
            for i in range(self.cfg.routers)
        ]
        specs += [
            ProcSpec("predictor", [*py, "services.predictor"], env("predictor")),
            ProcSpec("envmgr", [*py, "services.envmgr"], env("envmgr")),
            *self._gem_specs(env("envmgr", {"LOOM_ENVMGR_LANES": _gem_lane()})),
            ProcSpec("reward", [*py, "services.reward"], env("reward")),
        ]
        for i in range(self.cfg.workers):
            worker = {
                **env("rollout"),
                "LOOM_ROLLOUT_WORKER_ID": f"w{i}",
                "LOOM_ROLLOUT_MODEL": self.cfg.model,
                "LOOM_ROLLOUT_GPU": self.cfg.gpu,
                "LOOM_ROLLOUT_TP": str(self.cfg.tp),
                "LOOM_ROLLOUT_ENGINE": self.cfg.engine,
                "LOOM_ROLLOUT_SEED": str(i),
            }
            if self.cfg.model_path is not None:
                worker["LOOM_ROLLOUT_MODEL_PATH"] = self.cfg.model_path
            url_setting = engine_kinds.kind(self.cfg.engine).url_setting
            if url_setting is not None:
                worker[url_setting] = self.cfg.engine_urls[i % len(self.cfg.engine_urls)]
            specs.append(ProcSpec(f"rollout-w{i}", [*py, "services.rollout"], worker))
        return specs

    def _gem_specs(self, env: dict[str, str]) -> list[ProcSpec]:
        """The GEM environment manager, run by GEM's interpreter (the project is on its path, installed there as
        it is in the main venv, so ``-m services.envmgr`` is the same program)."""
        if not self.cfg.gem_python:
            return []
        return [ProcSpec("envmgr-gem", [self.cfg.gem_python, "-m", "services.envmgr"], env)]

    def check(self) -> None:
        """Refuse, before anything starts, what would only make services crash over and over: a service that
        cannot start is restarted forever, and all one sees is that it keeps crashing."""
        cfg = self.cfg
        try:
            Tokens.load(self.api_token, None)
        except AuthConfigError as e:
            raise DeployError(f"LOOM_API_TOKEN: {e}") from None
        if cfg.nats_cluster and cfg.nats_cluster < 3:
            raise DeployError(
                f"a NATS cluster needs at least 3 servers to survive one's loss, not {cfg.nats_cluster}"
            )
        if cfg.schedulers < 1 or cfg.routers < 1:
            raise DeployError("at least one scheduler and one router")
        try:
            engine = engine_kinds.kind(cfg.engine)
        except ValueError as e:
            raise DeployError(str(e)) from None
        if engine.serves_checkpoint and not cfg.model_path:
            raise DeployError(
                f"the {cfg.engine} engine serves real weights: give the checkpoint directory (--model-path)"
            )
        if engine.url_setting is not None and not cfg.engine_urls:
            raise DeployError(f"the {cfg.engine} engine drives servers: give their URLs (--engine-url)")
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", cfg.api_port))
            except OSError as e:
                raise DeployError(
                    f"the scheduler's port {cfg.api_port} is taken ({e.strerror}): choose --port"
                ) from None

    async def start(self, wait_s: float = 60.0) -> None:
        self.check()
        self.cfg.home.mkdir(parents=True, exist_ok=True)
        await self.nats.start()
        self.nats.supervise(self._write_state)
        self.standby_ports = [free_port() for _ in range(self.cfg.schedulers - 1)]
        for spec in self.service_specs():
            await self.sup.start(spec)
        self._write_state()
        await self.wait_healthy(wait_s)

    async def wait_healthy(self, wait_s: float) -> None:
        want = {
            "scheduler": self.cfg.schedulers,
            "router": self.cfg.routers,
            "predictor": 1,
            "envmgr": 2 if self.cfg.gem_python else 1,
            "reward": 1,
            "rollout": self.cfg.workers,
        }
        deadline = time.monotonic() + wait_s
        seen: dict[str, int] = {}
        while time.monotonic() < deadline:
            health = await gather_health(self.nats.url, 0.5, self.cfg.home)
            # Serving, not only answering: a rollout worker answers while its engine starts.
            seen = {s: sum(h.ready for h in hs) for s, hs in health.items()}
            if all(seen.get(s, 0) >= n for s, n in want.items()):
                return
            dead = [n for n, p in self.sup.procs.items() if p.restarts > 3]
            if dead:
                why = "; ".join(f"{n}: {last_error(self.cfg.home / 'logs' / f'{n}.log')}" for n in dead)
                raise DeployError(f"services keep crashing ({why}); see {self.cfg.home / 'logs'}")
            await asyncio.sleep(0.3)
        raise RuntimeError(f"services not serving after {wait_s:.0f} s: {seen}; see {self.cfg.home / 'logs'}")

    def nats_servers(self) -> list[NatsServer]:
        return self.nats.servers if isinstance(self.nats, NatsCluster) else [self.nats]

    def credentials(self, role: str) -> tuple[str, str]:
        """(user, password) for a client of this deployment in ``role`` (``loom.identity.nats_auth.ROLES``)."""
        return role, self.passwords[role]

    def _write_state(self) -> None:
        state = {
            "nats_url": self.nats.url,
            "api_url": self.api_url,
            # Every scheduler's API, the first one's port fixed (--port), the standbys' any free one.
            "api_urls": [self.api_url, *(f"http://127.0.0.1:{p}" for p in self.standby_ports)],
            "pids": self.sup.pids(),
            "nats_pids": [s.proc.pid for s in self.nats_servers() if s.proc is not None],
            "supervisor_pid": os.getpid(),
            "speed": self.cfg.speed,
            "epoch": self.epoch,
        }
        tmp = self.cfg.home / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.cfg.home / STATE_FILE)

    async def stop(self) -> None:
        await self.sup.stop()
        await self.nats.stop()
        (self.cfg.home / STATE_FILE).unlink(missing_ok=True)


def _gem_lane() -> str:
    """The work lane of GEM's trajectories, from the environment table (imported here: `loom up` alone needs it,
    and the table's task sets take a moment to import at every other command's start)."""
    from loom.envs import registry

    gem = registry.KINDS["gem:"]
    assert isinstance(gem, registry.Library)
    return gem.lane


def replica(name: str, i: int) -> str:
    """The supervised name of a service's ``i``-th instance: ``scheduler``, ``scheduler-2``, ..."""
    return name if i == 0 else f"{name}-{i + 1}"


def last_error(log_path: Path, lines: int = 200) -> str:
    """The last error a service logged before it died: its last traceback's final line, else its last
    ERROR/CRITICAL line, else its last line."""
    try:
        tail = log_path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "no log"
    for i in range(len(tail) - 1, -1, -1):
        if tail[i].startswith("Traceback"):
            rest = [t for t in tail[i + 1 :] if t and not t.startswith((" ", "\t"))]
            if rest:
                return rest[0].strip()
    marked = [t for t in tail if " ERROR " in t or " CRITICAL " in t]
    return (marked or tail or ["empty log"])[-1].strip()


async def gather_health(
    nats_url: str, wait: float = 1.0, home: Path | None = None
) -> dict[str, list[Health]]:
    """Every service instance's health, asked as the operator of the Loom in ``home`` (if it has users)."""
    return await gather(nats_url, wait, operator_credentials(home or default_home()))


def operator_credentials(home: Path) -> tuple[str, str] | None:
    """The operator's NATS user of the Loom ``loom up`` runs in ``home``; None where it made none."""
    password = nats_auth.stored(home / "nats").get(nats_auth.OPERATOR)
    return None if password is None else (nats_auth.OPERATOR, password)


def read_state(home: Path) -> dict[str, object]:
    path = home / STATE_FILE
    if not path.exists():
        raise SystemExit(f"no running Loom found ({path} missing): start one with `loom up`")
    data: dict[str, object] = json.loads(path.read_text())
    return data

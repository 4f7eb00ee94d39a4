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

from loom import nats_auth
from loom.auth import home_token
from loom.healthcheck import gather
from loom.natsserver import NatsServer
from loom.protocol import Health
from loom.supervisor import ProcSpec, Supervisor

log = logging.getLogger(__name__)

STATE_FILE = "state.json"


def default_home() -> Path:
    return Path(os.environ.get("LOOM_HOME", ".loom"))


def api_token(home: Path, create: bool = False) -> str:
    """The admin token the CLI presents: ``LOOM_API_TOKEN``, else the one ``loom up`` keeps in its home."""
    token = os.environ.get("LOOM_API_TOKEN") or home_token(home, create)
    if not token:
        raise SystemExit(f"no API token: set LOOM_API_TOKEN or start Loom with `loom up` ({home} has none)")
    return token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    # Rollout engine kind ("sim", or "hf" for real weights on the CPU from ``model_path``).
    engine: str = "sim"
    model_path: str | None = None
    # Extra environment for every service (e.g. the data directories a training run reads).
    extra_env: dict[str, str] = field(default_factory=dict)
    # The REST API's admin token: LOOM_API_TOKEN, else the one kept under ``home`` (made on first start).
    api_token: str | None = None


class Deployment:
    def __init__(self, cfg: DeployConfig) -> None:
        self.cfg = cfg
        # Every service, the trainer and the operator connect as their own NATS user; no one else can.
        self.passwords = nats_auth.passwords(cfg.home / "nats")
        self.nats = NatsServer(
            cfg.home / "nats", port=cfg.nats_port, authorization=nats_auth.authorization(self.passwords)
        )
        self.sup = Supervisor(cfg.home / "logs", on_change=self._write_state)
        self.api_url = f"http://127.0.0.1:{cfg.api_port}"
        self.api_token = cfg.api_token or api_token(cfg.home, create=True)
        self.epoch = time.time()

    def service_specs(self) -> list[ProcSpec]:
        common = {
            "LOOM_NATS_URL": self.nats.url,
            "LOOM_SPEED": repr(self.cfg.speed),
            "LOOM_CLOCK_EPOCH": repr(self.epoch),
            "LOOM_LOG_LEVEL": self.cfg.log_level,
            "PYTHONUNBUFFERED": "1",
            **self.cfg.extra_env,
        }

        def env(role: str, more: dict[str, str] | None = None) -> dict[str, str]:
            return {**common, **nats_auth.role_env(role, self.passwords[role]), **(more or {})}

        py = [sys.executable, "-m"]
        specs = [
            ProcSpec(
                "scheduler",
                [*py, "services.scheduler"],
                env(
                    "scheduler",
                    {"LOOM_SCHEDULER_PORT": str(self.cfg.api_port), "LOOM_API_TOKEN": self.api_token},
                ),
            ),
            ProcSpec("router", [*py, "services.router"], env("router")),
            ProcSpec("predictor", [*py, "services.predictor"], env("predictor")),
            ProcSpec("envmgr", [*py, "services.envmgr"], env("envmgr")),
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
            specs.append(ProcSpec(f"rollout-w{i}", [*py, "services.rollout"], worker))
        return specs

    async def start(self, wait_s: float = 60.0) -> None:
        self.cfg.home.mkdir(parents=True, exist_ok=True)
        await self.nats.start()
        self.nats.supervise()
        for spec in self.service_specs():
            await self.sup.start(spec)
        self._write_state()
        await self.wait_healthy(wait_s)

    async def wait_healthy(self, wait_s: float) -> None:
        want = {
            "scheduler": 1,
            "router": 1,
            "predictor": 1,
            "envmgr": 1,
            "reward": 1,
            "rollout": self.cfg.workers,
        }
        deadline = time.monotonic() + wait_s
        seen: dict[str, int] = {}
        while time.monotonic() < deadline:
            seen = {s: len(hs) for s, hs in (await gather_health(self.nats.url, 0.5, self.cfg.home)).items()}
            if all(seen.get(s, 0) >= n for s, n in want.items()):
                return
            dead = [n for n, p in self.sup.procs.items() if p.restarts > 3]
            if dead:
                raise RuntimeError(f"services keep crashing: {dead}; see {self.cfg.home / 'logs'}")
            await asyncio.sleep(0.3)
        raise RuntimeError(f"services not healthy after {wait_s:.0f} s: {seen}; see {self.cfg.home / 'logs'}")

    def credentials(self, role: str) -> tuple[str, str]:
        """(user, password) for a client of this deployment in ``role`` (``loom.nats_auth.ROLES``)."""
        return role, self.passwords[role]

    def _write_state(self) -> None:
        state = {
            "nats_url": self.nats.url,
            "api_url": self.api_url,
            "pids": self.sup.pids(),
            "nats_pid": self.nats.proc.pid if self.nats.proc is not None else None,
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

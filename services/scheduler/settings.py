from __future__ import annotations

import socket
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import SettingsConfigDict

from loom.settings import LoomSettings


class SchedulerSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_SCHEDULER_", populate_by_name=True, extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8080
    # Where the other instances reach this one's REST API (a standby forwards to the active one's); by default
    # the host and port it listens on (this machine's name where it listens on every interface).
    advertise: str | None = None
    traces_path: str | None = None
    # REST authentication (loom.identity.auth): the admin's bearer token, and a file of tenants' tokens. With neither
    # the scheduler does not start.
    api_token: str | None = Field(
        None, validation_alias=AliasChoices("api_token", "LOOM_API_TOKEN"), repr=False
    )
    tokens_file: Path | None = None
    # Intake limits: trajectories one job may have, trajectories a tenant may have in flight, request bodies.
    max_job_trajectories: int = Field(100_000, ge=1)
    tenant_max_trajectories: int = Field(200_000, ge=1)
    max_body_mb: float = Field(4.0, gt=0)
    # OpenAI gateway: how long a call waits for its session to start (its trajectory is queued behind others),
    # and for the reply (the generation, queued behind other trajectories' at the engines).
    session_start_wait_s: float = Field(60.0, ge=0)
    session_call_timeout_s: float = Field(900.0, gt=0)
    # How often pending jobs retry placement and running jobs are recounted (wall seconds).
    reconcile_s: float = 1.0
    # A job's progress (its record in KV) is saved at most this often while trajectories finish (wall
    # seconds); the one that finishes the job saves at once. A save rewrites the whole record, tasks and all.
    progress_save_s: float = Field(0.25, ge=0)
    # Co-scheduling of RL jobs (RollMux): group size cap, warm-start cost per phase, tail migration point.
    rollmux_max_group: int = Field(5, ge=1)
    rollmux_warm_start: bool = True
    rollmux_tail_threshold: float = Field(0.8, gt=0.0, le=1.0)
    rollmux_node_mem_gb: float = Field(2048.0, gt=0.0)

    def advertise_url(self) -> str:
        if self.advertise:
            return self.advertise
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

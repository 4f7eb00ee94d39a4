"""Per-service settings (pydantic-settings): shared fields read ``LOOM_*``, the rest a service prefix."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_instance() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def default_shared_dir() -> Path:
    """``../shared`` beside the project root, the data every workload reads."""
    env = os.environ.get("LOOM_SHARED_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared"


def cache_dir(*parts: str) -> Path:
    """A folder under ``$LOOM_CACHE`` (``~/.cache/loom``) for what Loom builds once and keeps, made if missing."""
    d = Path(os.environ.get("LOOM_CACHE", Path.home() / ".cache" / "loom")).joinpath(*parts)
    d.mkdir(parents=True, exist_ok=True)
    return d


class LoomSettings(BaseSettings):
    """Fields every service has. Subclasses set ``env_prefix`` for their own fields."""

    model_config = SettingsConfigDict(env_prefix="LOOM_", populate_by_name=True, extra="ignore")

    nats_url: str = Field("nats://127.0.0.1:4222", validation_alias=AliasChoices("nats_url", "LOOM_NATS_URL"))
    speed: float = Field(1.0, gt=0, validation_alias=AliasChoices("speed", "LOOM_SPEED"))
    clock_epoch: float | None = Field(None, validation_alias=AliasChoices("clock_epoch", "LOOM_CLOCK_EPOCH"))
    log_level: str = Field("INFO", validation_alias=AliasChoices("log_level", "LOOM_LOG_LEVEL"))
    instance: str = Field(
        default_factory=_default_instance, validation_alias=AliasChoices("instance", "LOOM_INSTANCE")
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, validation_alias=AliasChoices("metrics_port", "LOOM_METRICS_PORT")
    )
    shared_dir: Path = Field(
        default_factory=default_shared_dir, validation_alias=AliasChoices("shared_dir", "LOOM_SHARED_DIR")
    )
    # Who the service is on NATS (its role's user, loom.identity.nats_auth); the password, or a file holding it.
    nats_user: str | None = Field(None, validation_alias=AliasChoices("nats_user", "LOOM_NATS_USER"))
    # Plain (not SecretStr) so that the settings handed to forked reward workers as JSON keep it.
    nats_password: str | None = Field(
        None, repr=False, validation_alias=AliasChoices("nats_password", "LOOM_NATS_PASSWORD")
    )
    nats_password_file: Path | None = Field(
        None, validation_alias=AliasChoices("nats_password_file", "LOOM_NATS_PASSWORD_FILE")
    )
    # Longest a request may wait without hearing from the service holding it (wall seconds).
    lease_s: float = Field(3.0, gt=0, validation_alias=AliasChoices("lease_s", "LOOM_LEASE_S"))
    keepalive_s: float = Field(1.0, gt=0, validation_alias=AliasChoices("keepalive_s", "LOOM_KEEPALIVE_S"))

    def nats_credentials(self) -> tuple[str, str] | None:
        """(user, password) to connect to NATS with, or None for a server without authentication."""
        if self.nats_user is None:
            return None
        if self.nats_password is not None:
            return self.nats_user, self.nats_password
        if self.nats_password_file is not None:
            return self.nats_user, self.nats_password_file.read_text().strip()
        raise ValueError("LOOM_NATS_USER is set without LOOM_NATS_PASSWORD or LOOM_NATS_PASSWORD_FILE")

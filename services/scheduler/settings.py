from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from loom.settings import LoomSettings


class SchedulerSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_SCHEDULER_", populate_by_name=True, extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8080
    traces_path: str | None = None
    # How often pending jobs retry placement and running jobs are recounted (wall seconds).
    reconcile_s: float = 1.0

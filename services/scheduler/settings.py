from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loom.settings import LoomSettings


class SchedulerSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_SCHEDULER_", populate_by_name=True, extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8080
    traces_path: str | None = None
    # How often pending jobs retry placement and running jobs are recounted (wall seconds).
    reconcile_s: float = 1.0
    # Co-scheduling of RL jobs (RollMux): group size cap, warm-start cost per phase, tail migration point.
    rollmux_max_group: int = Field(5, ge=1)
    rollmux_warm_start: bool = True
    rollmux_tail_threshold: float = Field(0.8, gt=0.0, le=1.0)
    rollmux_node_mem_gb: float = Field(2048.0, gt=0.0)

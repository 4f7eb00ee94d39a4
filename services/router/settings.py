from __future__ import annotations

from pydantic_settings import SettingsConfigDict

from loom.settings import LoomSettings


class RouterSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ROUTER_", populate_by_name=True, extra="ignore")

    # How often the worker registry is re-read (wall seconds).
    registry_s: float = 1.0
    # Requests forwarded to one worker beyond its engine's max_running (keeps its batch full).
    overcommit: int = 0

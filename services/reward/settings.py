from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loom.settings import LoomSettings


class RewardSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_REWARD_", populate_by_name=True, extra="ignore")

    concurrency: int = Field(64, ge=1)
    # A request that fails this many deliveries goes to the dead-letter stream with its reason.
    max_deliver: int = Field(5, ge=1)
    ack_wait_s: float = 30.0

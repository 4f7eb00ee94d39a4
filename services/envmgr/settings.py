from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loom.sandbox.settings import SandboxSettings


class EnvmgrSettings(SandboxSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ENVMGR_", populate_by_name=True, extra="ignore")

    # Trajectories this instance runs at once.
    concurrency: int = Field(1024, ge=1)
    # A prediction that takes longer than the tool call is not waited for beyond this (wall seconds).
    predict_timeout_s: float = 2.0
    # Give up on a generation after hearing nothing for this long (wall seconds).
    gen_give_up_s: float = 300.0
    # JetStream ack deadline for a running trajectory; refreshed while it runs (wall seconds).
    ack_wait_s: float = 30.0

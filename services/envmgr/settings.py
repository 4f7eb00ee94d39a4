from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loom.sandbox.images import DEFAULT_IMAGE
from loom.settings import LoomSettings


class EnvmgrSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ENVMGR_", populate_by_name=True, extra="ignore")

    # Trajectories this instance runs at once.
    concurrency: int = Field(1024, ge=1)
    # A prediction that takes longer than the tool call is not waited for beyond this (wall seconds).
    predict_timeout_s: float = 2.0
    # Give up on a generation after hearing nothing for this long (wall seconds).
    gen_give_up_s: float = 300.0
    # JetStream ack deadline for a running trajectory; refreshed while it runs (wall seconds).
    ack_wait_s: float = 30.0
    # Sandboxes for the code and math environments: Docker when an engine answers, else processes.
    sandbox_backend: Literal["auto", "docker", "process"] = "auto"
    sandbox_image: str = DEFAULT_IMAGE
    sandbox_warm: int = Field(8, ge=0)
    sandbox_max: int = Field(256, ge=1)
    sandbox_cpus: float = Field(1.0, gt=0)
    sandbox_memory_mb: int = Field(512, ge=16)
    sandbox_pids: int = Field(128, ge=8)

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from loom.envs import registry
from loom.protocol import subjects
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
    # Which trajectory work this manager takes (loom.envs.registry.LANES), comma-separated: "main", every
    # environment but those of libraries with a virtualenv of their own, and such a library's lane ("gem"), for
    # a manager started from that virtualenv (`loom up` starts one where .venv-gem exists). Each lane has its
    # own consumer, running up to ``concurrency`` trajectories.
    lanes: str = subjects.MAIN_LANE

    @field_validator("lanes")
    @classmethod
    def _known_lanes(cls, v: str) -> str:
        lanes = [x.strip() for x in v.split(",") if x.strip()]
        unknown = sorted(set(lanes) - set(registry.LANES))
        if not lanes or unknown:
            raise ValueError(f"lanes must name some of {list(registry.LANES)}, not {v!r}")
        return ",".join(dict.fromkeys(lanes))

    def lane_list(self) -> list[str]:
        return self.lanes.split(",")

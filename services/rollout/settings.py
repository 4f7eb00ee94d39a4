from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from loom.engine import kinds
from loom.settings import LoomSettings


class RolloutSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ROLLOUT_", populate_by_name=True, extra="ignore")

    worker_id: str = Field("w0", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    # One of loom.engine.kinds.KINDS.
    engine: str = "sim"
    # Base URL of the SGLang server this worker drives (engine "sglang"), e.g. http://127.0.0.1:30000.
    sglang_url: str | None = None
    # Base URL of the vLLM server this worker drives (engine "vllm"), e.g. http://127.0.0.1:8000.
    vllm_url: str | None = None
    # Checkpoint directory (config.json + safetensors) the transformers engine serves (engine "hf").
    model_path: str | None = None
    # The version of the weights the engine starts with (engine "hf"); fleet updates move it on.
    weight_version: str = "0"
    # torch intra-op threads of the transformers engine.
    threads: int = Field(1, ge=1)
    # Seeds the transformers engine's sampling (with each request's rid).
    seed: int = 0
    # The transformers engine decodes speculatively, losslessly, with suffix-match drafts from each request's
    # own tokens and every request's output on the engine (loom.engine.clients.hf_spec).
    speculative: bool = False
    model: str = "qwen3-8b"
    gpu: str = "h100"
    tp: int = Field(1, ge=1, le=64)
    max_running: int = Field(256, ge=1)
    # Simulated engine's host KV tier as a multiple of its device pool (SGLang's --hicache-ratio; 0: off).
    hicache_ratio: float = Field(0.0, ge=0.0, le=64.0)
    # Simulated engine: the link its new weights arrive over, priced by RollArt Table 3 ("rdma" within the
    # trainer's cluster, "tcp" from another); unset, they load at once.
    weight_link: Literal["rdma", "tcp"] | None = None
    heartbeat_s: float = 1.0
    telemetry_s: float = 0.5
    # On SIGTERM, how long in-flight requests may run before they are aborted (wall seconds).
    drain_grace_s: float = 10.0

    @field_validator("engine")
    @classmethod
    def _known(cls, v: str) -> str:
        return kinds.kind(v).name

from __future__ import annotations

from pydantic import BaseModel, Field
from pydantic_settings import SettingsConfigDict

from loom.policies.autoscaler import ScalePolicy, TenantLimits
from loom.sandbox.settings import SandboxSettings


class TenantConfig(BaseModel):
    weight: float = Field(1.0, gt=0)
    min_workers: int = Field(0, ge=0)
    max_workers: int | None = Field(None, ge=0)

    def limits(self) -> TenantLimits:
        return TenantLimits(self.weight, self.min_workers, self.max_workers)


class RewardSettings(SandboxSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_REWARD_", populate_by_name=True, extra="ignore")

    # Requests one worker process runs at once (its slots); the autoscaler aims at `target` per worker.
    worker_slots: int = Field(2, ge=1)
    target: float = Field(2.0, gt=0)
    max_workers: int = Field(8, ge=1)
    # A fixed pool of this many workers instead of autoscaling (the dedicated-pool baseline).
    fixed_workers: int | None = Field(None, ge=1)
    stable_window_s: float = Field(6.0, gt=0)
    panic_window_s: float = Field(0.6, gt=0)
    panic_threshold: float = Field(2.0, gt=1)
    # No demand for this long and a tenant's workers go (to its min_workers, zero by default).
    scale_to_zero_grace_s: float = Field(2.0, ge=0)
    tick_s: float = Field(0.1, gt=0)
    # Per-tenant weight and bounds, e.g. LOOM_REWARD_TENANTS='{"team-a": {"weight": 2, "max_workers": 4}}'.
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    # Scoring deadline of one request (a request's ``deadline_s`` parameter overrides it): past it the
    # worker is killed and the request counts a failed delivery.
    deadline_s: float = Field(120.0, gt=0)
    # A request that fails this many deliveries goes to the dead-letter stream with its reason and its
    # trajectory is stored unscored, so the job still completes.
    max_deliver: int = Field(5, ge=1)
    ack_wait_s: float = Field(30.0, gt=0)
    # The worker's own sandboxes (code reward): none kept warm, a worker's first code request makes one.
    sandbox_warm: int = Field(0, ge=0)

    def scale_policy(self) -> ScalePolicy:
        return ScalePolicy(
            target=self.target,
            stable_window_s=self.stable_window_s,
            panic_window_s=min(self.panic_window_s, self.stable_window_s),
            panic_threshold=self.panic_threshold,
            scale_to_zero_grace_s=self.scale_to_zero_grace_s,
            max_workers=self.max_workers,
        )

from __future__ import annotations

from typing import Literal

from pydantic_settings import SettingsConfigDict

from loom.settings import LoomSettings


class PredictorSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_PREDICTOR_", populate_by_name=True, extra="ignore")

    method: Literal["history"] = "history"

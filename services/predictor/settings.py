from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from loom.predict import default_model_path
from loom.settings import LoomSettings


class PredictorSettings(LoomSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_PREDICTOR_", populate_by_name=True, extra="ignore")

    # auto: the learned model when its file exists, else (loudly) the history-based predictor.
    method: Literal["auto", "history"] = "auto"
    model_path: Path = Field(default_factory=default_model_path)
    max_batch: int = Field(32, ge=1)
    batch_wait_ms: float = Field(2.0, ge=0)
    # A request the model has not answered by then gets the history-based estimate instead.
    deadline_ms: float = Field(200.0, gt=0)
    threads: int = Field(2, ge=1)

"""Predictor service: progressive trajectory-length prediction."""

from __future__ import annotations

from loom.runtime import service
from services.predictor.service import PredictorService
from services.predictor.settings import PredictorSettings


def main() -> None:
    service.main("predictor", PredictorSettings, lambda rt: PredictorService(rt, rt.settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()

"""Predictor service: remaining-length estimates on ``loom.v1.predict``.

Until a learned model is configured it serves the history-based predictor, learning from every finished
trajectory; after a restart it relearns from the result stream's headers.
"""

from __future__ import annotations

import logging
from typing import Any

from nats.aio.msg import Msg

from loom import results
from loom.predict.history import HistoryPredictor
from loom.protocol import Prediction, PredictRequest, TrajDone, subjects
from loom.service import Runtime
from services.predictor.settings import PredictorSettings

log = logging.getLogger(__name__)


class PredictorService:
    def __init__(self, rt: Runtime, settings: PredictorSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.history = HistoryPredictor()
        self.m_requests = rt.metrics.counter("requests_total", "Predictions served", ["method"])

    def health(self) -> dict[str, Any]:
        return {"method": "history", "observed": self.history.overall.n}

    async def run(self, rt: Runtime) -> None:
        for h in await results.scan_headers(rt.js):
            if h.status == "completed":
                self.history.observe(h.task_id, h.output_tokens)
        log.info("history predictor learned %d trajectories", self.history.overall.n)
        await rt.subscribe(subjects.TRAJ_DONE_ALL, TrajDone, self.on_done)
        await rt.subscribe(subjects.PREDICT, PredictRequest, self.on_predict, queue=subjects.QUEUE_GROUP)
        await rt.stopping.wait()

    async def on_done(self, ev: TrajDone, _msg: Msg) -> None:
        if ev.status == "completed":
            self.history.observe(ev.task_id, ev.output_tokens)

    async def on_predict(self, req: PredictRequest, _msg: Msg) -> Prediction:
        self.m_requests.labels("history").inc()
        total = self.history.predict_total(req.task_id, req.generated_tokens)
        return Prediction(req.traj_id, max(0.0, total - req.generated_tokens), total, "history")

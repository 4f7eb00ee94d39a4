"""Predictor service: remaining-length estimates on ``loom.v1.predict``.

It serves the learned regressor (ONNX Runtime, micro-batched, with a deadline) when its model file exists,
and combines its total with everything else known of the trajectory (``loom.predict.combine``, the
combiner ``loom predictor train`` fitted on held-out prompts and wrote beside the model): the prompt's
earlier samples (finished trajectories of the same task in other groups or jobs: its history), its group's
finished samples and running ones (their progress, from their own requests), its step and what it
generated. All of it arrives on subjects the service already hears: nothing is asked of the caller but the
trajectory's group, prompt length and workload (its trace set, where the task names one). A request the
model cannot read (no context, or past its deadline) is still combined, without the text; a model exported
before combiners existed is refined by the finished samples of the same prompt alone (``loom.predict.blend``).

When a sample finishes, the estimates of its group's unfinished samples move, and the service publishes them
as priority updates, so a sibling still waiting in a router's queue is re-keyed (and, with migration, may
move) before it has a tool call of its own to be predicted during.
Without a model it answers with the history-based predictor, which learns from every finished trajectory
and, after a restart, relearns from the result stream's headers (so does the combiner's history). Every
fallback is counted by reason and the missing model is logged loudly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from loom.predict.batcher import MicroBatcher
from loom.predict.blend import SiblingBlend
from loom.predict.combine import Combiner, Known, prepare
from loom.predict.history import HistoryPredictor
from loom.protocol import Prediction, PredictRequest, PriorityUpdate, TrajDone, encode, subjects
from loom.runtime import results
from loom.runtime.bus import kv_key
from loom.runtime.service import Runtime
from services.predictor.settings import PredictorSettings

log = logging.getLogger(__name__)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# A model exported without its measured error is trusted as little as this (log sd) until finished
# trajectories measure it.
UNCALIBRATED_LOG_SD = 1.0
# Admission estimates kept to measure the model against the trajectories' true totals; the oldest go first.
MAX_ADMITTED = 100_000
# Finished samples kept per task (its history and its groups' finished samples), the newest.
MAX_DONE_PER_TASK = 64


@dataclass
class _Latest:
    """A running trajectory's last request and model estimate: its siblings read its progress, and their
    finishing re-estimates it."""

    job_id: str
    traj_id: str
    task_id: str
    group: int
    model_total: float | None
    generated: int
    step: int
    context_len: int
    prompt_tokens: int
    workload: str
    # It has text whose model total what serves it does not read (``Combiner.total_unread``): none was run.
    text_unread: bool = False


class PredictorService:
    def __init__(self, rt: Runtime, settings: PredictorSettings) -> None:
        self.rt = rt
        self.settings = settings
        self.history = HistoryPredictor()
        self.model: Any = None
        self.blend: SiblingBlend | None = None
        self.combiner: Combiner | None = None
        self.admitted: dict[str, float] = {}  # the model's total for each trajectory at admission
        self.latest: dict[str, _Latest] = {}  # by job.traj, while it runs
        self.running: dict[tuple[str, str, int], set[str]] = {}  # (job, task, group) -> keys in ``latest``
        # task -> (job, group, total) of its finished samples, in the order they finished
        self.done: dict[str, collections.deque[tuple[str, int, float]]] = {}
        self.batcher: MicroBatcher[Any, float] | None = None
        self.unavailable = ""
        m = rt.metrics
        self.m_requests = m.counter("requests_total", "Predictions served", ["method"])
        self.m_fallbacks = m.counter("fallbacks_total", "History answers instead of the model", ["reason"])
        self.m_batch = m.histogram("batch_size", "Requests per model call", buckets=BATCH_BUCKETS)
        self.m_batch_s = m.histogram("batch_seconds", "Model call latency")
        self.m_refreshed = m.counter("sibling_updates_total", "Priority updates after a sibling finished")
        self.m_unread = m.counter(
            "text_unread_total",
            "Requests with text answered without the text model, which their estimate does not read",
        )
        self._load_model()

    def _load_model(self) -> None:
        path = self.settings.model_path
        if self.settings.method == "history":
            self.unavailable = "configured to serve the history-based predictor"
            return
        if not path.exists():
            self.unavailable = f"no model at {path} (train one with `loom predictor train`)"
            log.warning("PREDICTOR FALLBACK: %s; serving the history-based predictor", self.unavailable)
            return
        from loom.predict.onnx_model import OnnxRegressor

        self.model = OnnxRegressor(path, threads=self.settings.threads)
        self.combiner = self.model.combiner
        if self.combiner is None:
            log.warning("the model at %s has no combiner (retrain it): siblings alone refine it", path)
            self.blend = SiblingBlend(self.model.admission_log_sd or UNCALIBRATED_LOG_SD)
        self.batcher = MicroBatcher(
            self._run_batch,
            max_batch=self.settings.max_batch,
            max_wait_s=self.settings.batch_wait_ms / 1000,
            on_batch=self._observe_batch,
        )
        log.info("serving the %s predictor from %s", self.model.method, path)

    def _run_batch(self, queries: Sequence[Any]) -> list[float]:
        return [float(r) for r in self.model.remaining(queries)]

    def _observe_batch(self, size: int, seconds: float) -> None:
        self.m_batch.observe(size)
        self.m_batch_s.observe(seconds)

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.model.method if self.model else "history",
            "observed": self.history.overall.n,
        }
        if self.model:
            out["model_path"] = str(self.settings.model_path)
            out["combined"] = self.combiner is not None
        if self.blend:
            out["blend"] = self.blend.spreads()
        if not self.model:
            out["fallback"] = self.unavailable
        return out

    async def run(self, rt: Runtime) -> None:
        for h in await results.scan_headers(rt.js):
            if h.status == "completed":
                self.history.observe(h.task_id, h.output_tokens)
                self._done(h.job_id, h.task_id, h.group, h.output_tokens)
                if self.blend:
                    self.blend.observe(h.task_id, h.output_tokens)
        log.info("history predictor learned %d trajectories", self.history.overall.n)
        await rt.subscribe(subjects.TRAJ_DONE_ALL, TrajDone, self.on_done)
        await rt.subscribe(subjects.PREDICT, PredictRequest, self.on_predict, queue=subjects.QUEUE_GROUP)
        rt.mark_ready()  # the history relearnt from the result stream, and subscribed
        try:
            await rt.stopping.wait()
        finally:
            if self.batcher:
                await self.batcher.close()

    async def on_done(self, ev: TrajDone, _msg: Msg) -> None:
        admitted = self.admitted.pop(ev.traj_id, None)
        key = kv_key(ev.job_id, ev.traj_id)
        self._forget(key)
        if ev.status == "completed":
            self.history.observe(ev.task_id, ev.output_tokens)
            self._done(ev.job_id, ev.task_id, ev.group, ev.output_tokens)
            if self.blend:
                self.blend.observe(ev.task_id, ev.output_tokens, admitted)
            if self.model is not None:
                await self._refresh_siblings(ev.job_id, ev.task_id, ev.group)

    def _done(self, job_id: str, task_id: str, group: int, total: int) -> None:
        kept = self.done.setdefault(task_id, collections.deque(maxlen=MAX_DONE_PER_TASK))
        kept.append((job_id, group, float(total)))

    def _known(self, t: _Latest, key: str) -> Known:
        """What is known of a trajectory now: its last request, its task's finished samples (its group's are
        its siblings, the rest its history) and its running siblings' progress."""
        siblings: list[float] = []
        history: list[float] = []
        for job, group, total in self.done.get(t.task_id, ()):
            same = job == t.job_id and group == t.group and t.group >= 0
            (siblings if same else history).append(total)
        running = [
            (self.latest[k].step, float(self.latest[k].generated))
            for k in self.running.get((t.job_id, t.task_id, t.group), ())
            if k != key and t.group >= 0
        ]
        prompt = t.prompt_tokens or (t.context_len if t.step == 0 else 0)
        return Known(
            t.step,
            float(t.generated),
            float(prompt),
            t.model_total,
            tuple(history),
            tuple(siblings),
            tuple(running),
            t.workload,
        )

    def _estimate(self, t: _Latest, key: str) -> float | None:
        """Its estimate now; None where its last request was answered without the text model (``text_unread``)
        and what serves it now reads that model's total (a history appeared): it keeps its estimate until its
        next request runs the model, rather than be ranked by the regime without text beside siblings ranked
        by the one with it."""
        if self.combiner is not None:
            known = self._known(t, key)
            if t.text_unread:
                return self.combiner.total_unread(prepare(known))
            return self.combiner.total(known)
        assert self.blend is not None and t.model_total is not None
        return self.blend.total(t.task_id, t.model_total, t.generated)

    def _trust(self, workload: str) -> tuple[float, float]:
        """How far placement may trust the estimates: their error at admission (log sd) and how much of their
        ranking within the workload is real (slope), as measured on prompts the model never saw."""
        if self.combiner is not None:
            return self.combiner.trust(workload)
        assert self.blend is not None and self.model is not None
        return self.blend.model.sd, self.model.admission_slope

    async def _refresh_siblings(self, job_id: str, task_id: str, group: int) -> None:
        assert self.model is not None
        groups = (
            [group]
            if self.combiner is not None
            else [g for j, k, g in self.running if j == job_id and k == task_id]
        )
        keys = {k for g in groups for k in self.running.get((job_id, task_id, g), ())}
        for key in sorted(keys):
            t = self.latest[key]
            if t.model_total is None and self.combiner is None:
                continue
            total = self._estimate(t, key)
            if total is None:
                continue
            upd = PriorityUpdate(
                job_id,
                t.traj_id,
                total,
                total - t.generated,
                t.step,
                context_len=t.context_len,
                generated_tokens=t.generated,
                method=self.model.method,
            )
            await self.rt.nc.publish(subjects.CONTROL_PRIORITY, encode(upd))
            self.m_refreshed.inc()

    def _remember(self, req: PredictRequest, model_total: float | None) -> tuple[_Latest, str]:
        key = kv_key(req.job_id, req.traj_id)
        before = self.latest.get(key)
        # Forgotten and re-inserted: the oldest first in line to be forgotten, in the group it now names.
        self._forget(key)
        prompt = req.prompt_tokens or (before.prompt_tokens if before else 0)
        t = _Latest(
            req.job_id,
            req.traj_id,
            req.task_id,
            req.group,
            model_total,
            req.generated_tokens,
            req.step,
            req.context_len,
            prompt,
            req.workload,
        )
        self.latest[key] = t
        self.running.setdefault((req.job_id, req.task_id, req.group), set()).add(key)
        if len(self.latest) > MAX_ADMITTED:  # trajectories that never finished: forget the oldest
            self._forget(next(iter(self.latest)))
        return t, key

    def _forget(self, key: str) -> None:
        t = self.latest.pop(key, None)
        if t is None:
            return
        members = self.running.get((t.job_id, t.task_id, t.group))
        if members is not None:
            members.discard(key)
            if not members:
                del self.running[(t.job_id, t.task_id, t.group)]

    async def on_predict(self, req: PredictRequest, _msg: Msg) -> Prediction:
        if self.batcher is not None:
            # What the combiner reads but the text model's total is worked out now, while the text model runs
            # on its thread: once it answers, a sum is left (``loom.predict.combine.prepare``).
            combiner, prepared = self.combiner, None
            if combiner is not None:
                t, key = self._remember(req, None)
                prepared = prepare(self._known(t, key))
            remaining = None
            if req.prompt or req.pieces:
                # Where what serves the trajectory ranks by something else (search by its previous epoch,
                # say), the text model's total would be computed for nothing: no tokenising, no batch.
                unread = None if combiner is None or prepared is None else combiner.total_unread(prepared)
                if unread is not None:
                    # Named as the model's answers are: the same estimate, which the router migrates on.
                    t.text_unread = True
                    self.m_unread.inc()
                    self.m_requests.labels(self.model.method).inc()
                    return Prediction(
                        req.traj_id,
                        unread - req.generated_tokens,
                        unread,
                        self.model.method,
                        *self._trust(req.workload),
                    )
                remaining = await self._model_remaining(req)
            else:
                self.m_fallbacks.labels("no_context").inc()
            model_total = None if remaining is None else req.generated_tokens + remaining
            if model_total is not None or self.combiner is not None:
                # Without the text, the combiner still has the rest (its cell without the text model).
                method = self.model.method if model_total is not None else "combined"
                self.m_requests.labels(method).inc()
                if req.step == 0 and model_total is not None:
                    self._admit(req.traj_id, model_total)
                if combiner is not None and prepared is not None:
                    t.model_total = model_total  # for its siblings' finishing to re-estimate it
                    total = combiner.total_prepared(prepared, model_total)
                else:
                    t, key = self._remember(req, model_total)
                    blended = self._estimate(t, key)
                    assert blended is not None  # the blend's: it reads the text model's total it was given
                    total = blended
                return Prediction(
                    req.traj_id, total - req.generated_tokens, total, method, *self._trust(req.workload)
                )
        self.m_requests.labels("history").inc()
        total = self.history.predict_total(req.task_id, req.generated_tokens)
        return Prediction(req.traj_id, max(0.0, total - req.generated_tokens), total, "history")

    def _admit(self, traj_id: str, total: float) -> None:
        self.admitted[traj_id] = total
        if len(self.admitted) > MAX_ADMITTED:  # trajectories that never finished: forget the oldest
            del self.admitted[next(iter(self.admitted))]

    async def _model_remaining(self, req: PredictRequest) -> float | None:
        from loom.predict.onnx_model import query

        assert self.batcher is not None
        try:
            # Tokenising a long context takes milliseconds: off the event loop.
            q = await asyncio.to_thread(
                query, req.prompt, req.pieces, req.step, req.generated_tokens, req.context_len
            )
            return await self.batcher.submit(q, self.settings.deadline_ms / 1000)
        except TimeoutError:
            self.m_fallbacks.labels("deadline").inc()
        except Exception:
            log.exception("model prediction failed for %s step %d", req.traj_id, req.step)
            self.m_fallbacks.labels("error").inc()
        return None

"""A rollout worker: one inference engine behind NATS.

It serves ``loom.v1.worker.<id>.gen``, answers each caller's inbox directly, keeps callers alive with
keepalives, and dedupes by request id: a caller that re-sends after a lost router attaches to the running
request or gets the stored result, so a step is never generated twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from loom.engine.base import Engine, EngineRequest
from loom.protocol import (
    AbortRequest,
    FleetWeights,
    GenError,
    GenKeepalive,
    GenRequest,
    GenResult,
    WarmDone,
    WarmPrefix,
    WeightOp,
    WeightOpReply,
    WeightsRef,
    WorkerDone,
    WorkerInfo,
    WorkerLoad,
    decode,
    encode,
    subjects,
)
from loom.runtime.service import Runtime
from loom.weights import Incoming
from services.rollout.settings import RolloutSettings

log = logging.getLogger(__name__)

RESULT_CACHE = 8192


@dataclass
class Inflight:
    req: GenRequest
    waiters: set[str] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class RolloutWorker:
    def __init__(self, rt: Runtime, settings: RolloutSettings, engine: Engine) -> None:
        self.rt = rt
        self.settings = settings
        self.engine = engine
        self.id = settings.worker_id
        self.inflight: dict[str, Inflight] = {}
        self.completed: OrderedDict[str, GenResult] = OrderedDict()
        self.started_at = time.time()
        m = rt.metrics
        self.m_requests = m.counter("requests_total", "Generation requests served", ["outcome"])
        self.m_tokens = m.counter("generated_tokens_total", "Output tokens generated")
        self.m_dedup = m.counter("deduplicated_total", "Re-sent requests answered without regenerating")
        self.m_latency = m.histogram("request_seconds", "Engine time per request (simulated)")
        self.m_running = m.gauge("running", "Sequences in the engine batch")
        self.m_waiting = m.gauge("waiting", "Requests queued in the engine")
        self.m_warmed = m.counter("warmed_tokens_total", "Prefix tokens loaded for migrated trajectories")
        self.m_weight_ops = m.counter("weight_ops_total", "Steps of fleet weight updates", ["op", "outcome"])
        self.weight_version = settings.weight_version
        self._pause_lease: asyncio.Task[None] | None = None

    def info(self) -> WorkerInfo:
        e = self.engine.info
        return WorkerInfo(
            worker_id=self.id,
            model=e.model,
            engine=e.kind,
            gpu=e.gpu,
            tp=e.tp,
            max_running=e.max_running,
            kv_capacity_tokens=e.kv_capacity_tokens,
            max_context_tokens=e.max_context_tokens,
            started_at=self.started_at,
            heartbeat_at=time.time(),
        )

    def health(self) -> dict[str, Any]:
        ld = self.engine.load()
        return {
            "worker_id": self.id,
            "engine": self.engine.info.kind,
            "running": ld.running,
            "waiting": ld.waiting,
            "weight_version": self.weight_version,
        }

    async def run(self, rt: Runtime) -> None:
        await self.engine.start()
        await self._join_fleet(rt)
        self.kv = await rt.js.key_value(subjects.KV_WORKERS)
        await rt.subscribe(subjects.worker_weights(self.id), WeightOp, self.on_weights)
        await self.kv.put(self.id, encode(self.info()))
        gen_sub = await rt.subscribe(subjects.worker_gen(self.id), GenRequest, self.on_gen)
        await rt.subscribe(subjects.worker_abort(self.id), AbortRequest, self.on_abort)
        await rt.subscribe(subjects.worker_warm(self.id), WarmPrefix, self.on_warm)
        # It takes requests: its engine is up, it has joined the fleet's weights (or holds its requests for the
        # next update, after a broadcast it missed) and its handlers are subscribed.
        rt.mark_ready()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._every(self.settings.heartbeat_s, self._heartbeat))
                tg.create_task(self._every(self.settings.telemetry_s, self._telemetry))
                tg.create_task(self._every(self.settings.keepalive_s, self._keepalive))
                await rt.stopping.wait()
                await gen_sub.unsubscribe()
                await self._drain()
        finally:
            with contextlib.suppress(Exception):
                await self.kv.delete(self.id)
            await self.engine.close()

    async def _join_fleet(self, rt: Runtime) -> None:
        """Serve what the fleet of this model serves before taking any request: a worker that (re)starts
        after a weight update must not answer with the weights it was started with."""
        kv = await rt.js.key_value(subjects.KV_WEIGHTS)
        try:
            entry = await kv.get(self.engine.info.model)
        except KeyNotFoundError:
            return
        if not entry.value:
            return
        fleet = decode(entry.value, FleetWeights)
        if fleet.version == self.weight_version:
            return
        ref = fleet.weights if fleet.weights is not None else WeightsRef("disk", fleet.path)
        if ref.transport == "collective":
            # Broadcast weights cannot be fetched afterwards: hold every request until the next update (this
            # worker is in its group) brings the fleet's weights here, rather than answer with others.
            log.warning(
                "the fleet of %s is at version %s, broadcast before this worker started: holding requests "
                "until the next update",
                self.engine.info.model,
                fleet.version,
            )
            await self.engine.pause()
            return
        log.info("joining the fleet at weight version %s (%s)", fleet.version, ref.transport)
        await self.engine.prepare_weights(fleet.version, Incoming(ref, rt.js))
        await self.engine.commit_weights(fleet.version)
        self.weight_version = fleet.version

    async def on_weights(self, op: WeightOp, _msg: Msg) -> WeightOpReply:
        """One step of a fleet update (pause, prepare, commit or discard, resume), run by the scheduler."""
        if op.op in ("pause", "resume") and self._pause_lease is not None:
            self._pause_lease.cancel()
            self._pause_lease = None
        try:
            if op.op == "pause":
                await self.engine.pause()
                if op.lease_s > 0:
                    self._pause_lease = asyncio.create_task(self._unpause_after(op.lease_s, op.version))
            elif op.op == "prepare":
                ref = op.weights if op.weights is not None else WeightsRef("disk", op.path)
                await self.engine.prepare_weights(
                    op.version, Incoming(ref, self.rt.js, op.timeout_s or 600.0)
                )
            elif op.op == "commit":
                await self.engine.commit_weights(op.version)
                self.weight_version = op.version
            elif op.op == "discard":
                await self.engine.discard_weights(op.version)
            else:
                await self.engine.resume()
        except Exception as e:
            log.warning("weights %s %s failed: %s", op.op, op.version, e)
            self.m_weight_ops.labels(op.op, "error").inc()
            return WeightOpReply(self.id, False, self.weight_version, f"{type(e).__name__}: {e}")
        self.m_weight_ops.labels(op.op, "ok").inc()
        return WeightOpReply(self.id, True, self.weight_version)

    async def _unpause_after(self, seconds: float, version: str) -> None:
        await asyncio.sleep(seconds)
        log.warning("paused %.0f s for weights %s with no commit or resume: resuming", seconds, version)
        self.m_weight_ops.labels("pause", "expired").inc()
        with contextlib.suppress(Exception):
            await self.engine.discard_weights(version)
        await self.engine.resume()
        self._pause_lease = None

    async def _drain(self) -> None:
        tasks = [i.task for i in self.inflight.values() if i.task is not None]
        if tasks:
            log.info("draining %d in-flight requests", len(tasks))
            _, pending = await asyncio.wait(tasks, timeout=self.settings.drain_grace_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _every(self, period: float, fn: Any) -> None:
        while not self.rt.stopping.is_set():
            try:
                await fn()
            except Exception as e:
                log.warning("%s failed: %s", fn.__name__, e)
            await self.rt.wait_stop(period)

    async def _heartbeat(self) -> None:
        await self.kv.put(self.id, encode(self.info()))

    async def _telemetry(self) -> None:
        ld = self.engine.load()
        self.m_running.set(ld.running)
        self.m_waiting.set(ld.waiting)
        load = WorkerLoad(
            worker_id=self.id,
            running=ld.running,
            waiting=ld.waiting,
            inflight=len(self.inflight),
            kv_used_tokens=ld.kv_used_tokens,
            kv_capacity_tokens=ld.kv_capacity_tokens,
            generated_tokens=ld.generated_tokens,
            at=time.time(),
            rids=list(self.inflight),
        )
        await self.rt.nc.publish(subjects.telemetry("worker", self.id), encode(load))

    async def _keepalive(self) -> None:
        for rid, inf in list(self.inflight.items()):
            for inbox in list(inf.waiters):
                await self.rt.nc.publish(inbox, encode(GenKeepalive(rid, self.id, "running")))

    async def on_gen(self, req: GenRequest, msg: Msg) -> None:
        if not req.reply_to:
            await self.rt.reject(msg, "forwarded request without reply_to")
            return
        done = self.completed.get(req.rid)
        if done is not None:
            self.m_dedup.inc()
            await self.rt.nc.publish(req.reply_to, encode(done))
            await self.rt.nc.publish(subjects.worker_done(self.id), encode(WorkerDone(self.id, req.rid)))
            return
        inf = self.inflight.get(req.rid)
        if inf is not None:
            self.m_dedup.inc()
            inf.waiters.add(req.reply_to)
            return
        inf = self.inflight[req.rid] = Inflight(req, {req.reply_to})
        inf.task = asyncio.create_task(self._serve(inf), name=f"gen-{req.rid}")

    async def _serve(self, inf: Inflight) -> None:
        req = inf.req
        ereq = EngineRequest(
            rid=req.rid,
            input_len=req.input_len,
            max_new_tokens=req.max_new_tokens,
            input_ids=req.input_ids,
            prefix_key=f"{req.job_id}.{req.traj_id}",
            ignore_eos=req.ignore_eos,
            priority=req.priority,
            temperature=req.temperature,
            top_p=req.top_p,
            return_logprob=req.return_logprob,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            top_logprobs=req.top_logprobs,
            forced_ids=req.forced_ids,
            seed=req.seed,
        )
        reply: GenResult | GenError
        try:
            out = await self.engine.generate(ereq)
            reply = GenResult(
                rid=req.rid,
                worker_id=self.id,
                output_len=out.output_len,
                finish_reason=out.finish_reason,
                output_ids=out.output_ids,
                queue_s=out.queue_s,
                prefill_s=out.prefill_s,
                decode_s=out.decode_s,
                cached_tokens=out.cached_tokens,
                weight_version=out.weight_version,
                output_logprobs=out.output_logprobs,
                output_top_logprobs=out.output_top_logprobs,
            )
            self.m_tokens.inc(out.output_len)
            self.m_latency.observe(out.queue_s + out.prefill_s + out.decode_s)
            self.m_requests.labels(out.finish_reason).inc()
            if out.finish_reason != "abort":
                self.completed[req.rid] = reply
                while len(self.completed) > RESULT_CACHE:
                    self.completed.popitem(last=False)
        except ValueError as e:  # the engine refuses the request itself (e.g. larger than its KV cache)
            reply = GenError(req.rid, "invalid_request", str(e), retryable=False)
            self.m_requests.labels("invalid").inc()
        except asyncio.CancelledError:
            reply = GenError(req.rid, "aborted", "worker shutting down", retryable=True)
            self.m_requests.labels("cancelled").inc()
        except Exception as e:
            log.exception("engine failed on %s", req.rid)
            reply = GenError(req.rid, "engine_error", str(e), retryable=True)
            self.m_requests.labels("error").inc()
        finally:
            self.inflight.pop(req.rid, None)
        for inbox in inf.waiters:
            await self.rt.nc.publish(inbox, encode(reply))
        done = WorkerDone(self.id, req.rid)
        if isinstance(reply, GenResult):
            done = WorkerDone(
                self.id, req.rid, reply.output_len, reply.prefill_s + reply.decode_s, reply.queue_s
            )
        await self.rt.nc.publish(subjects.worker_done(self.id), encode(done))

    async def on_warm(self, w: WarmPrefix, _msg: Msg) -> WarmDone:
        """Migration target: load the trajectory's prefix now, while its tool call runs."""
        key = f"{w.job_id}.{w.traj_id}"
        importer = getattr(self.engine, "import_prefix", None)
        if importer is not None:
            # The simulated engine lands the KV at link bandwidth, as Heddle moves it over GPU-direct RDMA.
            await importer(key, w.input_len)
        else:
            # SGLang has no per-request KV import: a prefill-only request recomputes the prefix.
            await self.engine.warm_prefix(key, w.input_len)
        self.m_warmed.inc(w.input_len)
        return WarmDone(self.id, key, w.input_len)

    async def on_abort(self, a: AbortRequest, _msg: Msg) -> None:
        for rid, inf in list(self.inflight.items()):
            r = inf.req
            if (a.rid is not None and rid == a.rid) or (
                a.rid is None
                and (a.job_id is None or r.job_id == a.job_id)
                and (a.traj_id is None or r.traj_id == a.traj_id)
                and (a.job_id is not None or a.traj_id is not None)
            ):
                await self.engine.abort(rid)

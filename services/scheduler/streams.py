"""Rollout streams: jobs that never end, feeding a trainer through a per-stream sample buffer.

The stream manager keeps groups flowing from the data set while fewer than ``buffer_groups`` are running or
waiting for the trainer, and only when the asynchronous bound would still admit them when the trainer can
next take them (``loom.policies.staleness``). It assembles finished trajectories into groups from the result
stream (a durable headers-only consumer, acknowledged after the stream's record holds what it learned) and
publishes each complete group once to the sample buffer. A group with a member the bound aborted is given up
and its task sampled again.

Everything is in JetStream: the record in KV ``loom_streams`` (rewritten on every change, with the groups
still open), the buffer in ``LOOM_SAMPLES``, the work in the trajectory queue. A restarted scheduler resumes
from them, and message ids make every publication idempotent, so no group is lost or delivered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError

from loom.policies.staleness import AsyncBound, groups_to_start, task_at
from loom.protocol import (
    AbortRequest,
    BatchTaken,
    CancelJob,
    ErrorReply,
    FleetWeights,
    GroupRestart,
    Job,
    OpenGroup,
    SampleGroup,
    Stream,
    StreamRef,
    StreamSpec,
    StreamVersion,
    WeightOp,
    WeightOpKind,
    WeightOpReply,
    WeightsRef,
    WeightUpdate,
    WeightUpdateResult,
    decode,
    encode,
    subjects,
)
from loom.runtime import results
from loom.runtime.bus import kv_values, open_kv, request, through_failover
from loom.runtime.service import Runtime
from loom.runtime.workers import FLEET_MEMBER_S, read_workers
from services.scheduler.settings import SchedulerSettings
from services.scheduler.tasks import (
    SpecError,
    check_context,
    group_works,
    resolve_tasks,
    samples_per_group,
    work_subject,
)

log = logging.getLogger(__name__)

TERMINAL = ("completed", "cancelled", "failed")
# Groups a stream may keep open: each is an entry of its record, rewritten on every change.
MAX_OPEN_GROUPS = 4096


class StreamError(Exception):
    """A request the stream cannot honour (unknown, ended, a weight update that failed); ``code`` for REST."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StreamManager:
    def __init__(
        self, rt: Runtime, settings: SchedulerSettings, jobs_in_flight: Callable[[str], int] = lambda _: 0
    ) -> None:
        self.rt = rt
        self.settings = settings
        # A tenant's quota counts its jobs' trajectories in flight beside its streams'.
        self.jobs_in_flight = jobs_in_flight
        self.streams: dict[str, Stream] = {}
        self.tasks: dict[str, list] = {}  # stream -> its resolved TaskSpecs
        self._locks: dict[str, asyncio.Lock] = {}
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._tp: dict[str, int] = {}  # each rollout worker's tensor parallelism, as the registry last said
        self._assemblers: dict[str, asyncio.Task[None]] = {}
        m = rt.metrics
        self.m_groups = m.counter("stream_groups_total", "Stream groups by outcome", ["outcome"])
        self.m_updates = m.counter("weight_updates_total", "Fleet weight updates", ["outcome"])
        self.m_pause = m.histogram("weight_update_pause_seconds", "Engines paused per fleet update (wall)")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        # Read through the elections a standby may take over during (``jobs.JobManager.start``).
        js = self.rt.js
        self.kv = await open_kv(js, subjects.KV_STREAMS)
        self.kv_jobs = await open_kv(js, subjects.KV_JOBS)
        self.kv_groups = await open_kv(js, subjects.KV_GROUPS)
        self.kv_weights = await open_kv(js, subjects.KV_WEIGHTS)
        for value in await kv_values(js, self.kv, subjects.KV_STREAMS):
            st = decode(value, Stream)
            self.streams[st.id] = st
        for st in list(self.streams.values()):
            if st.state == "running":
                await self._load_tasks(st)
            if st.id in self.tasks:
                await self._republish_open(self.streams[st.id])
                self._assemble(st.id)
        rt = self.rt
        await rt.subscribe(subjects.STREAM_CREATE, StreamSpec, self._nats(self._create))
        await rt.subscribe(subjects.STREAM_GET, StreamRef, self._nats(self._get))
        await rt.subscribe(subjects.STREAM_CANCEL, StreamRef, self._nats(self._cancel))
        await rt.subscribe(subjects.STREAM_LEASE, StreamRef, self._nats(self._lease))
        await rt.subscribe(subjects.STREAM_TAKEN, BatchTaken, self._nats(self._taken))
        await rt.subscribe(subjects.STREAM_WEIGHTS, WeightUpdate, self._nats(self._weights))
        log.info("reloaded %d streams", len(self.streams))

    def _nats(self, fn: Callable[[Any], Awaitable[Any]]) -> Callable[[Any, Msg], Awaitable[Any]]:
        """A NATS handler around ``fn``: its errors answer as ErrorReply instead of an internal error."""

        async def handler(obj: Any, _msg: Msg) -> Any:
            try:
                return await fn(obj)
            except StreamError as e:
                return ErrorReply(e.code, e.message)
            except SpecError as e:
                return ErrorReply("invalid", f"{'.'.join(map(str, e.loc))}: {e.msg}")

        return handler

    async def _create(self, spec: StreamSpec) -> Stream:
        return await self.create(spec)

    async def _get(self, ref: StreamRef) -> Stream:
        return self.get(ref.stream_id)

    async def _cancel(self, ref: StreamRef) -> Stream:
        return await self.cancel(ref.stream_id)

    async def _lease(self, ref: StreamRef) -> Stream:
        return await self.renew(ref.stream_id)

    async def _taken(self, b: BatchTaken) -> Stream:
        return await self.taken(b)

    async def _weights(self, u: WeightUpdate) -> WeightUpdateResult:
        return await self.update_weights(u)

    async def close(self) -> None:
        for t in self._assemblers.values():
            t.cancel()
        await asyncio.gather(*self._assemblers.values(), return_exceptions=True)

    async def lease_forever(self) -> None:
        """Release streams whose trainer stopped renewing its lease."""
        while not self.rt.stopping.is_set():
            now = time.time()
            for st in list(self.streams.values()):
                if st.state == "running" and st.lease_until < now:
                    log.warning("stream %s: trainer lease expired", st.id)
                    with contextlib.suppress(StreamError):
                        await self.cancel(st.id, error="trainer lease expired")
            await self.rt.wait_stop(1.0)

    # ------------------------------------------------------------------ requests

    def get(self, stream_id: str) -> Stream:
        st = self.streams.get(stream_id)
        if st is None:
            raise StreamError("not_found", f"unknown stream {stream_id!r}")
        return st

    def in_flight(self, tenant: str) -> int:
        """The most trajectories the tenant's running streams keep in flight (their open groups' samples)."""
        return sum(
            _bound(st.spec)
            for st in self.streams.values()
            if st.spec.tenant == tenant and st.state == "running"
        )

    async def create(self, spec: StreamSpec) -> Stream:
        job_spec = spec.job_spec()
        if job_spec.env == "external":
            # Sessions belong to jobs (GET /v1/jobs/{id}/sessions); a stream's would have no one to drive them.
            raise SpecError(["env"], "an external agent drives a job's sessions, not a rollout stream's")
        tasks = resolve_tasks(job_spec, self.settings.traces_path)  # raises SpecError
        check_context(job_spec, (await read_workers(self.rt.js)).values())
        # The record holds every open group and the work queue every sample of them: both stay bounded.
        in_flight = _bound(spec)
        if spec.buffer_groups > MAX_OPEN_GROUPS or in_flight > self.settings.max_job_trajectories:
            raise SpecError(
                ["buffer_groups"],
                f"{spec.buffer_groups} groups of {samples_per_group(job_spec)} in flight: a stream may keep at "
                f"most {MAX_OPEN_GROUPS} groups and {self.settings.max_job_trajectories} trajectories in flight",
            )
        tenant = spec.tenant
        held = self.in_flight(tenant) + self.jobs_in_flight(tenant)
        if held + in_flight > self.settings.tenant_max_trajectories:
            raise StreamError(
                "quota",
                f"tenant {tenant!r} has {held} trajectories in flight; a stream of {in_flight} more would pass "
                f"its quota of {self.settings.tenant_max_trajectories}",
            )
        sid = f"str-{uuid.uuid4().hex[:12]}"
        now = self.rt.clock.now()
        st = Stream(
            id=sid,
            spec=spec,
            state="running",
            created_at=now,
            lease_until=time.time() + spec.lease_s,
            n_tasks=len(tasks),
        )
        # Routers and environment managers read a stream's policy and state as any job's. Without its tasks:
        # they read the record per trajectory, and a data set of thousands of tasks made it a megabyte.
        job = Job(
            id=sid,
            spec=msgspec.structs.replace(job_spec, tasks=[]),
            state="running",
            created_at=now,
            n_trajectories=0,
            started_at=now,
            kind="stream",
        )
        await self.kv_jobs.put(sid, encode(job))
        self.tasks[sid] = tasks
        await self._save(st)
        log.info(
            "stream %s: %d tasks, bound %d, buffer %d groups",
            sid,
            len(tasks),
            spec.async_bound,
            spec.buffer_groups,
        )
        self._assemble(sid)
        await self._refill(sid)
        return self.streams[sid]

    async def renew(self, stream_id: str) -> Stream:
        async with self._lock(stream_id):
            st = self._running(stream_id)
            await self._save(msgspec.structs.replace(st, lease_until=time.time() + st.spec.lease_s))
        return self.streams[stream_id]

    async def taken(self, b: BatchTaken) -> Stream:
        """The trainer took these groups (and dropped ``stale`` ones the bound no longer admits)."""
        async with self._lock(b.stream_id):
            if self.get(b.stream_id).state == "completed":
                # The last report asked again, its answer lost: its groups were counted, and they completed it.
                return self.streams[b.stream_id]
            st = self._running(b.stream_id)
            opened = dict(st.open)
            retry = list(st.retry)
            # Only the groups still open count: a report asked again (its answer lost) counts once.
            delivered = [g for g in b.groups if opened.pop(g, None) is not None]
            stale = [og.pos for og in (opened.pop(g, None) for g in b.stale) if og is not None]
            retry += stale
            self.m_groups.labels("delivered").inc(len(delivered))
            self.m_groups.labels("stale_in_buffer").inc(len(stale))
            st = msgspec.structs.replace(
                st,
                open=opened,
                retry=retry,
                delivered=st.delivered + len(delivered),
                stale_groups=st.stale_groups + len(stale),
                # A report of stale groups alone (found while the trainer waits) takes no batch.
                consumed_version=max(st.consumed_version, b.version) if b.groups else st.consumed_version,
                lease_until=time.time() + st.spec.lease_s,
            )
            await self._save(self._maybe_complete(st))
        await self._refill(b.stream_id)
        return self.streams[b.stream_id]

    async def cancel(self, stream_id: str, error: str | None = None) -> Stream:
        async with self._lock(stream_id):
            st = self.get(stream_id)
            if st.state in TERMINAL:
                return st
            await self._save(
                msgspec.structs.replace(st, state="cancelled", finished_at=self.rt.clock.now(), error=error)
            )
        await self._end_job(stream_id, "cancelled", error)
        js = self.rt.js
        await js.purge_stream(subjects.STREAM_TRAJWORK, subject=subjects.traj_work(stream_id))
        # And what waits in the library lanes (gem: work goes to managers of its own).
        await js.purge_stream(subjects.STREAM_TRAJWORK, subject=subjects.traj_work_lanes(stream_id))
        await self.rt.nc.publish(subjects.CONTROL_CANCEL, encode(CancelJob(stream_id)))
        await self.rt.nc.publish(subjects.GEN_ABORT, encode(AbortRequest(job_id=stream_id)))
        task = self._assemblers.pop(stream_id, None)
        if task is not None:
            task.cancel()
        log.info("stream %s cancelled%s", stream_id, f": {error}" if error else "")
        return self.streams[stream_id]

    # ------------------------------------------------------------------ weights

    async def update_weights(self, u: WeightUpdate) -> WeightUpdateResult:
        """Move the stream's model's whole fleet to ``u.version`` (``move_fleet``); inside the pause the stream
        takes the version and the bound aborts what it no longer admits, before the workers resume.

        Under ``async_fetch`` the requests running meanwhile go on under the old weights; they are within
        the bound (a stream at bound 0 starts nothing while its batch trains, so nothing runs then)."""
        st = self._running(u.stream_id)
        if u.version <= st.version:
            raise StreamError("conflict", f"version {u.version} is not after the stream's {st.version}")

        async def switched() -> None:
            async with self._lock(u.stream_id):
                now = self.get(u.stream_id)
                await self._save(msgspec.structs.replace(now, version=u.version))
            # Before generation resumes: stale trajectories stop instead of generating under new weights.
            await self.rt.nc.publish(
                subjects.CONTROL_VERSION,
                encode(StreamVersion(u.stream_id, u.version, st.spec.async_bound)),
            )

        result = await self.move_fleet(st.spec.model, u, switched)
        log.info("stream %s: fleet at version %s", u.stream_id, u.version)
        await self._refill(u.stream_id)
        return result

    async def fleet_version(self, model: str) -> FleetWeights | None:
        """The weights every worker of ``model`` serves, as the last fleet update left them (None: never moved)."""
        try:
            entry = await self.kv_weights.get(model)
        except KeyNotFoundError:
            return None
        return decode(entry.value, FleetWeights) if entry.value else None

    async def move_fleet(
        self, model: str, u: WeightUpdate, switched: Callable[[], Awaitable[None]] | None = None
    ) -> WeightUpdateResult:
        """Move every rollout worker of ``model`` to ``u.version`` from ``u.path``: prepare the weights on each
        (while they generate, under ``u.async_fetch``; else inside the pause), and only if all prepared, pause
        all and commit on all; otherwise discard everywhere, so the fleet is never mixed. ``switched`` runs
        after the commit, before the workers resume."""
        async with self._model_locks.setdefault(model, asyncio.Lock()):
            t0 = time.monotonic()
            workers = await self._members(model)
            if not workers:
                raise StreamError("unavailable", f"no rollout worker serves {model!r}")
            version = str(u.version)
            ref = u.ref()
            if ref.transport == "collective":
                # One group: the trainer at rank 0, then each worker's engine, in the order the registry lists
                # them, a rank per GPU of its tensor parallelism (a server joins at its offset + its TP rank).
                offsets, world = {}, 1
                for w in workers:
                    offsets[w], world = world, world + self._tp.get(w, 1)
                refs = {w: msgspec.structs.replace(ref, rank=offsets[w], world_size=world) for w in workers}
                u = msgspec.structs.replace(u, async_fetch=False)
            else:
                refs = dict.fromkeys(workers, ref)
            fetch_s = 0.0
            if u.async_fetch:
                fetching = time.monotonic()
                await self._prepare(refs, version, u)
                fetch_s = time.monotonic() - fetching
            try:
                await self._fleet("pause", workers, version, None, u.timeout_s, lease_s=4 * u.timeout_s)
            except StreamError:
                if u.async_fetch:
                    await self._fleet("discard", workers, version, None, u.timeout_s, strict=False)
                raise
            paused = time.monotonic()
            try:
                if not u.async_fetch:
                    await self._prepare(refs, version, u)
                await self._commit(model, workers, version, u.timeout_s)
                fleet = FleetWeights(
                    model, version, ref.path, time.time(), None if ref.transport == "disk" else ref
                )
                await self.kv_weights.put(model, encode(fleet))
                if switched is not None:
                    await switched()
            finally:
                await self._fleet("resume", workers, version, None, u.timeout_s, strict=False)
                self.m_pause.observe(time.monotonic() - paused)
            self.m_updates.labels("ok").inc()
            log.info("model %s: fleet of %d at version %s", model, len(workers), version)
            return WeightUpdateResult(
                u.version, workers, time.monotonic() - paused, time.monotonic() - t0, fetch_s=fetch_s
            )

    async def _members(self, model: str, attempts: int = 3) -> list[str]:
        """The workers of ``model``'s fleet. A registry read that finds no worker at all is tried again a second
        later: the key-value listing behind it can come back empty for a moment (seen once in 30 updates of a
        training run whose worker was serving), and a missed worker would fail the update. One that lists other
        models' workers was read whole: ``model`` has none, said at once (a request for a model nobody serves
        waited two seconds, once past a client's ten under load)."""
        for attempt in range(attempts):
            members = await read_workers(self.rt.js, within_s=FLEET_MEMBER_S)
            workers = sorted(w for w, i in members.items() if i.model == model)
            self._tp.update({w: members[w].tp for w in workers})
            if workers or members or attempt == attempts - 1:
                return workers
            log.warning("no worker of %s in the registry; reading it again", model)
            await asyncio.sleep(1.0)
        return []

    async def _prepare(self, refs: dict[str, WeightsRef], version: str, u: WeightUpdate) -> None:
        """Load the weights beside the serving ones on every worker; if any fails, drop them everywhere."""
        workers = list(refs)
        failed = await self._fleet("prepare", workers, version, refs, u.timeout_s, strict=False)
        if failed:
            await self._fleet("discard", workers, version, None, u.timeout_s, strict=False)
            self.m_updates.labels("failed").inc()
            reasons = "; ".join(f"{w}: {e}" for w, e in sorted(failed.items()))
            raise StreamError("update_failed", f"weights {version} not loaded, fleet kept: {reasons}")

    async def _commit(self, model: str, workers: list[str], version: str, timeout_s: float) -> None:
        """Switch every prepared worker. A commit that fails where loading happens at commit (SGLang loads in
        place) rolls the others back to the fleet's previous checkpoint, so the fleet stays on one version."""
        failed = await self._fleet("commit", workers, version, None, timeout_s, strict=False)
        if not failed:
            return
        self.m_updates.labels("failed").inc()
        reasons = "; ".join(f"{w}: {e}" for w, e in sorted(failed.items()))
        try:
            entry = await self.kv_weights.get(model)
            prev = decode(entry.value, FleetWeights) if entry.value else None
        except KeyNotFoundError:
            prev = None
        done = [w for w in workers if w not in failed]
        # A collective version has gone by: the fleet's previous one can be taken again only from a disk or store.
        if prev is not None and done and (prev.weights is None or prev.weights.transport != "collective"):
            back = prev.weights if prev.weights is not None else WeightsRef("disk", prev.path)
            await self._fleet(
                "prepare", done, prev.version, dict.fromkeys(done, back), timeout_s, strict=False
            )
            await self._fleet("commit", done, prev.version, None, timeout_s, strict=False)
            raise StreamError(
                "update_failed", f"commit of {version} failed, fleet rolled back to {prev.version}: {reasons}"
            )
        raise StreamError(
            "update_failed", f"commit of {version} failed on {sorted(failed)} ({reasons}); {done} switched"
        )

    async def _fleet(
        self,
        op: WeightOpKind,
        workers: list[str],
        version: str,
        refs: dict[str, WeightsRef] | None,
        timeout_s: float,
        strict: bool = True,
        lease_s: float = 0.0,
    ) -> dict[str, str]:
        """Send one step to every worker at once (``refs``: each one's weights, for a prepare); returns the
        failures (raises on any when ``strict``)."""

        async def one(w: str) -> tuple[str, str]:
            ref = refs[w] if refs is not None else None
            try:
                r = await request(
                    self.rt.nc,
                    subjects.worker_weights(w),
                    WeightOp(op, version, ref.path if ref is not None else None, lease_s, timeout_s, ref),
                    WeightOpReply,
                    timeout_s,
                )
            except Exception as e:
                return w, f"{type(e).__name__}: {e}"
            return w, "" if r.ok else r.error

        answers = await asyncio.gather(*(one(w) for w in workers))
        failed = {w: e for w, e in answers if e}
        if failed and strict:
            raise StreamError(
                "update_failed", f"{op} failed on " + "; ".join(f"{w}: {e}" for w, e in failed.items())
            )
        return failed

    # ------------------------------------------------------------------ refill

    async def _refill(self, stream_id: str) -> None:
        async with self._lock(stream_id):
            st = self.streams.get(stream_id)
            if st is None or st.state != "running":
                return
            spec = st.spec
            if not AsyncBound(spec.async_bound).may_start(st.version, st.consumed_version):
                return
            total = None if spec.epochs is None else spec.epochs * st.n_tasks
            remaining = None if total is None else total - st.next_pos + len(st.retry)
            n = groups_to_start(len(st.open), spec.buffer_groups, remaining)
            if n == 0:
                return
            opened, retry = dict(st.open), list(st.retry)
            next_pos, next_group = st.next_pos, st.next_group
            tasks = self.tasks[stream_id]
            started: list[int] = []
            for _ in range(n):
                if retry:
                    pos = retry.pop(0)
                else:
                    pos, next_pos = next_pos, next_pos + 1
                task = tasks[task_at(pos, st.n_tasks, spec.shuffle, spec.shuffle_seed)]
                opened[next_group] = OpenGroup(pos=pos, task_id=task.id)
                started.append(next_group)
                next_group += 1
            # The record first, then the work: a crash in between re-publishes the open groups' work on
            # restart, which the work stream drops as duplicates.
            await self._save(
                msgspec.structs.replace(
                    st, open=opened, retry=retry, next_pos=next_pos, next_group=next_group
                )
            )
        self.m_groups.labels("started").inc(len(started))
        for g in started:
            await self._publish_work(self.streams[stream_id], g)

    async def _publish_work(self, st: Stream, group: int) -> None:
        og = st.open[group]
        task = self.tasks[st.id][task_at(og.pos, st.n_tasks, st.spec.shuffle, st.spec.shuffle_seed)]
        subject = work_subject(st.id, st.spec.env)
        for w in group_works(st.id, st.spec.job_spec(), task, group, st.spec.async_bound):
            # Through an election of the work stream's leader: the record already holds the group open, and
            # the message id makes a publish that landed before its answer was lost count once.
            await through_failover(
                functools.partial(
                    self.rt.js.publish,
                    subject,
                    encode(w),
                    headers={"Nats-Msg-Id": results.msg_id(st.id, w.traj_id)},
                )
            )

    async def _republish_open(self, st: Stream) -> None:
        for g, og in st.open.items():
            if not og.buffered:
                await self._publish_work(st, g)

    # ------------------------------------------------------------------ assembly

    def _assemble(self, stream_id: str) -> None:
        if stream_id not in self._assemblers:
            self._assemblers[stream_id] = asyncio.create_task(
                self._assemble_forever(stream_id), name=f"assemble-{stream_id}"
            )

    async def _assemble_forever(self, stream_id: str) -> None:
        durable = f"streams-{stream_id}"
        cfg = ConsumerConfig(
            durable_name=durable,
            headers_only=True,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30.0,
            max_ack_pending=10_000,
        )
        sub = await self.rt.js.pull_subscribe(
            subjects.results(stream_id), durable=durable, stream=subjects.STREAM_RESULTS, config=cfg
        )
        while not self.rt.stopping.is_set():
            st = self.streams.get(stream_id)
            if st is None or st.state in TERMINAL:
                break
            try:
                msgs = await sub.fetch(256, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as e:
                log.warning("stream %s: result fetch failed: %s", stream_id, e)
                await self.rt.wait_stop(1.0)
                continue
            try:
                await self._absorb(stream_id, msgs)
            except Exception:
                log.exception("stream %s: assembling groups failed", stream_id)
                continue
            for m in msgs:
                await m.ack()
        with contextlib.suppress(Exception):
            st = self.streams.get(stream_id)
            if st is not None and st.state in TERMINAL:
                await self.rt.js.delete_consumer(subjects.STREAM_RESULTS, durable)

    async def _absorb(self, stream_id: str, msgs: list[Msg]) -> None:
        """Record finished members in their open groups; publish the groups that completed; give up the groups
        the bound aborted. The record is saved before the messages are acknowledged."""
        restarts: list[tuple[int, str]] = []
        complete: list[int] = []
        async with self._lock(stream_id):
            st = self.streams[stream_id]
            if st.state != "running":
                return
            opened = dict(st.open)
            retry = list(st.retry)
            for m in msgs:
                h = results.header_of(m.subject, m.metadata.sequence.stream, m.headers or {})
                og = opened.get(h.group)
                if og is None or og.buffered or h.traj_id in og.done:
                    continue  # a group given up or published already, or a redelivery
                if h.status == "aborted":
                    if h.finish_reason.startswith("redundant"):
                        continue  # its group kept the first group_size samples
                    opened.pop(h.group)
                    retry.append(og.pos)
                    restarts.append((h.group, h.finish_reason))
                    continue
                done = {**og.done, h.traj_id: h.seq}
                start = og.start_version
                if h.start_version is not None:
                    start = h.start_version if start is None else min(start, h.start_version)
                og = msgspec.structs.replace(og, done=done, start_version=start)
                if len(done) >= st.spec.group_size and h.group not in complete:
                    complete.append(h.group)
                opened[h.group] = og
            for g in complete:
                og = opened[g]
                members = sorted(og.done.items())[: st.spec.group_size]
                sample = SampleGroup(
                    stream_id=stream_id,
                    group=g,
                    task_id=og.task_id,
                    start_version=og.start_version if og.start_version is not None else st.version,
                    traj_ids=[t for t, _ in members],
                    seqs=[s for _, s in members],
                )
                await self.rt.js.publish(
                    subjects.samples(stream_id), encode(sample), headers={"Nats-Msg-Id": f"{stream_id}.g{g}"}
                )
                opened[g] = msgspec.structs.replace(og, buffered=True)
            if not (restarts or complete or opened != st.open):
                return
            await self._save(
                msgspec.structs.replace(
                    st, open=opened, retry=retry, stale_groups=st.stale_groups + len(restarts)
                )
            )
        self.m_groups.labels("buffered").inc(len(complete))
        self.m_groups.labels("restarted").inc(len(restarts))
        for g, reason in restarts:
            await self.kv_groups.put(subjects.group_restarted_key(stream_id, g), b"1")
            await self.rt.nc.publish(
                subjects.CONTROL_GROUP_RESTART, encode(GroupRestart(stream_id, g, reason))
            )
            log.info("stream %s: group %d restarted (%s)", stream_id, g, reason)
        if restarts:
            await self._refill(stream_id)

    # ------------------------------------------------------------------ store

    def _lock(self, stream_id: str) -> asyncio.Lock:
        return self._locks.setdefault(stream_id, asyncio.Lock())

    def _running(self, stream_id: str) -> Stream:
        st = self.get(stream_id)
        if st.state != "running":
            why = f" ({st.error})" if st.error else ""
            raise StreamError("gone", f"stream {stream_id} is {st.state}{why}")
        return st

    def _maybe_complete(self, st: Stream) -> Stream:
        total = None if st.spec.epochs is None else st.spec.epochs * st.n_tasks
        if total is not None and st.next_pos >= total and not st.retry and not st.open:
            log.info("stream %s completed: %d groups delivered", st.id, st.delivered)
            return msgspec.structs.replace(st, state="completed", finished_at=self.rt.clock.now())
        return st

    async def _save(self, st: Stream) -> None:
        # Through an election of the bucket's leader: the whole record is put, so a repeat is harmless.
        await through_failover(functools.partial(self.kv.put, st.id, encode(st)))
        self.streams[st.id] = st
        if st.state in TERMINAL and st.state != "cancelled":
            await self._end_job(st.id, st.state, st.error)

    async def _end_job(self, stream_id: str, state: str, error: str | None) -> None:
        with contextlib.suppress(KeyNotFoundError):
            entry = await self.kv_jobs.get(stream_id)
            if entry.value:
                job = decode(entry.value, Job)
                await self.kv_jobs.put(
                    stream_id,
                    encode(
                        msgspec.structs.replace(
                            job, state=state, finished_at=self.rt.clock.now(), error=error
                        )
                    ),
                )

    async def _load_tasks(self, st: Stream) -> None:
        """Resolve the stream's tasks again (data sets resolve the same way every time; inline tasks are in
        its spec)."""
        try:
            tasks = resolve_tasks(st.spec.job_spec(), self.settings.traces_path)
        except SpecError as e:
            await self._save(msgspec.structs.replace(st, state="failed", error=f"its tasks: {e.msg}"))
            return
        if len(tasks) != st.n_tasks:
            await self._save(msgspec.structs.replace(st, state="failed", error="its data set changed"))
            return
        self.tasks[st.id] = tasks

    def health(self) -> dict[str, object]:
        running = [s for s in self.streams.values() if s.state == "running"]
        return {
            "streams": {
                s.id: {"version": s.version, "open": len(s.open), "delivered": s.delivered} for s in running
            }
        }


def _bound(spec: StreamSpec) -> int:
    """The most trajectories a stream keeps in flight: its open groups' samples."""
    return spec.buffer_groups * samples_per_group(spec.job_spec())

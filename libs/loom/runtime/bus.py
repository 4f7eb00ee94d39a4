"""NATS helpers: connect with reconnect, typed request with deadline, idempotent streams and KV buckets."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyNotFoundError, NoStreamResponseError, ServiceUnavailableError
from nats.js.kv import KeyValue

from loom.protocol import DecodeError, ErrorReply, decode, encode, subjects

log = logging.getLogger(__name__)
T = TypeVar("T")

# Payload ceiling for one message. A trajectory with 145 steps of 3 kB actions and observations must fit.
MAX_PAYLOAD = 8 * 1024 * 1024


class BusError(RuntimeError):
    """The other side answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# What JetStream answers a write while a replicated stream elects a new leader (a server of a cluster died):
# the API has no leader (503), or no stream took the publish. Either way nothing was written, so the request
# that made it may be asked again; services answer it with ``FAILOVER`` for their callers to retry.
JS_FAILING_OVER = (ServiceUnavailableError, NoStreamResponseError)
FAILOVER = "failover"
FAILOVER_S = 30.0  # a leader election takes a few seconds; this long, it is something else
# And what an election may also look like to a read, or to a write that may have landed: no one answered the
# API, or no answer came in time. Only an idempotent operation may be tried again after these.
JS_ELECTING = (*JS_FAILING_OVER, NoRespondersError, NatsTimeoutError)


async def through_failover(op: Callable[[], Awaitable[T]]) -> T:
    """An idempotent JetStream operation (a read, a put of a whole record, a publish with a message id), done
    again while the streams elect leaders (``JS_ELECTING``), for up to ``FAILOVER_S``."""
    deadline = time.monotonic() + FAILOVER_S
    while True:
        try:
            return await op()
        except JS_ELECTING:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def inbox_prefix(user: str) -> str:
    """Where a role's replies arrive: a prefix of its own, so that no other role may listen in."""
    return f"_INBOX_{user}"


async def connect(
    url: str,
    name: str,
    *,
    max_reconnect_attempts: int = -1,
    credentials: tuple[str, str] | None = None,
    connect_timeout: float = 5,
) -> NATS:
    """Connect and keep reconnecting forever; a service outlives NATS restarts. ``url`` may list several
    servers of a cluster, comma-separated: the client connects to one and moves to another when it goes.
    ``credentials`` (user, password), else any in the URL (``nats://user:password@host:port``), name the
    client's role on a server with authentication (``loom.identity.nats_auth``); its replies then come back under
    its role's own inbox prefix, the only inboxes it may subscribe to."""
    client: list[NATS] = []

    async def on_error(e: Exception) -> None:
        log.warning("nats error: %s", e)

    async def on_disconnect() -> None:
        # nats-py reports its own close() as a disconnection too: only a lost connection is news.
        if client and client[0].is_closed:
            log.debug("nats connection closed")
        else:
            log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info(
            "nats reconnected to %s",
            client[0].connected_url.netloc if client and client[0].connected_url else "?",
        )

    listed = servers(url)
    user = credentials[0] if credentials else urlsplit(listed[0]).username
    auth = {"user": credentials[0], "password": credentials[1]} if credentials else {}
    nc = await nats.connect(
        servers=listed,
        name=name,
        # nats-py reads 0 as "never give up" where it picks a server (it discards one only past a positive
        # count), so a client that must fail fast (a health check) tries each server once instead.
        max_reconnect_attempts=1 if max_reconnect_attempts == 0 else max_reconnect_attempts,
        allow_reconnect=max_reconnect_attempts != 0,
        reconnect_time_wait=0.5,
        connect_timeout=connect_timeout,
        inbox_prefix=inbox_prefix(user) if user else "_INBOX",
        **auth,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        pending_size=64 * 1024 * 1024,
    )
    client.append(nc)
    return nc


def servers(url: str) -> list[str]:
    """The servers a NATS URL lists (``LOOM_NATS_URL`` may name a cluster's: ``nats://a:4222,nats://b:4222``)."""
    listed = [u.strip() for u in url.split(",") if u.strip()]
    if not listed:
        raise ValueError("the NATS URL names no server")
    return listed


async def request(nc: NATS, subject: str, payload: Any, reply_type: type[T], timeout_s: float = 5.0) -> T:
    """Typed request/reply: raises ``BusError`` when the responder sends an ``ErrorReply``."""
    msg = await nc.request(subject, encode(payload), timeout=timeout_s)
    return decode_reply(msg.data, reply_type)


def decode_reply(data: bytes, reply_type: type[T]) -> T:
    # ErrorReply is tagged, so it only decodes from an error; reply types need no tag of their own.
    try:
        err = decode(data, ErrorReply)
    except DecodeError:
        return decode(data, reply_type)
    raise BusError(err.code, err.message)


@dataclass(frozen=True)
class Retention:
    """How long and how much the bus keeps (every stream and the per-trajectory KV buckets); from
    ``LOOM_RETENTION_DAYS`` (14), ``LOOM_RESULTS_MAX_GB`` (4, the result stream) and ``LOOM_QUEUE_MAX_GB``
    (1, each other stream). JetStream reserves each stream's bytes in its store, so together they must fit
    the server's file store (8 GB by default). Past its bytes a log stream drops its oldest messages; a work
    queue refuses new work instead (the publisher fails and retries) rather than dropping queued
    trajectories."""

    days: float = 14.0
    results_gb: float = 4.0
    queue_gb: float = 1.0

    @classmethod
    def from_env(cls) -> Retention:
        return cls(
            float(os.environ.get("LOOM_RETENTION_DAYS", cls.days)),
            float(os.environ.get("LOOM_RESULTS_MAX_GB", cls.results_gb)),
            float(os.environ.get("LOOM_QUEUE_MAX_GB", cls.queue_gb)),
        )

    @property
    def age_s(self) -> float:
        return self.days * 24 * 3600.0


def js_replicas() -> int:
    """How many servers hold each stream and bucket (``LOOM_JS_REPLICAS``: 1, or 3 on a cluster, where any one
    server may die with nothing lost). An existing deployment's are changed in place at the next start."""
    raw = os.environ.get("LOOM_JS_REPLICAS", "1")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(
            f"LOOM_JS_REPLICAS must be a whole number of servers (1 to 5), not {raw!r}"
        ) from None
    if not 1 <= n <= 5:  # JetStream's own bound
        raise ValueError(f"LOOM_JS_REPLICAS must lie between 1 and 5, not {n}")
    return n


def _stream_configs(keep: Retention | None = None, replicas: int = 1) -> list[StreamConfig]:
    keep = keep or Retention.from_env()
    common: dict[str, Any] = {
        "storage": StorageType.FILE,
        "max_msg_size": MAX_PAYLOAD,
        "max_age": keep.age_s,
        "num_replicas": replicas,
    }
    queue_bytes = int(keep.queue_gb * 2**30)
    return [
        StreamConfig(
            name=subjects.STREAM_TRAJWORK,
            subjects=subjects.STREAM_TRAJWORK_SUBJECTS,
            retention=RetentionPolicy.WORK_QUEUE,
            duplicate_window=600.0,
            max_bytes=queue_bytes,
            discard=DiscardPolicy.NEW,
            **common,
        ),
        StreamConfig(
            name=subjects.STREAM_REWARD,
            subjects=subjects.STREAM_REWARD_SUBJECTS,
            retention=RetentionPolicy.WORK_QUEUE,
            duplicate_window=600.0,
            max_bytes=queue_bytes,
            discard=DiscardPolicy.NEW,
            **common,
        ),
        StreamConfig(
            name=subjects.STREAM_RESULTS,
            subjects=subjects.STREAM_RESULTS_SUBJECTS,
            retention=RetentionPolicy.LIMITS,
            # Result idempotency: a redelivered reward request republishes under the same Nats-Msg-Id.
            duplicate_window=3600.0,
            discard=DiscardPolicy.OLD,
            max_bytes=int(keep.results_gb * 2**30),
            allow_direct=True,
            **common,
        ),
        StreamConfig(
            # Each rollout stream's sample buffer: finished groups, one message each, kept until the stream
            # ends (the scheduler purges its subject); a group is published once under Nats-Msg-Id
            # <stream>.g<group>, whatever restarts happen in between.
            name=subjects.STREAM_SAMPLES,
            subjects=subjects.STREAM_SAMPLES_SUBJECTS,
            retention=RetentionPolicy.LIMITS,
            duplicate_window=3600.0,
            max_bytes=queue_bytes,
            allow_direct=True,
            **common,
        ),
        StreamConfig(
            name=subjects.STREAM_DLQ,
            subjects=subjects.STREAM_DLQ_SUBJECTS,
            retention=RetentionPolicy.LIMITS,
            max_bytes=queue_bytes,
            **common,
        ),
    ]


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config=config)
    except BadRequestError as e:
        if e.err_code != 10058:  # "stream name already in use with a different configuration"
            raise
        await js.update_stream(config=config)


async def ensure_streams(js: JetStreamContext) -> None:
    """Create Loom's streams and KV buckets; safe to call from every service at every start."""
    keep = Retention.from_env()
    replicas = js_replicas()
    for cfg in _stream_configs(keep, replicas):
        await ensure_stream(js, cfg)
    # Records of finished work expire with the results they describe.
    await ensure_kv(js, subjects.KV_JOBS, ttl=keep.age_s, replicas=replicas)
    await ensure_kv(js, subjects.KV_TRAJ, ttl=keep.age_s, replicas=replicas)
    await ensure_kv(js, subjects.KV_GROUPS, ttl=keep.age_s, replicas=replicas)
    await ensure_kv(js, subjects.KV_WORKERS, ttl=15.0, replicas=replicas)
    await ensure_kv(js, subjects.KV_RLJOBS, replicas=replicas)
    await ensure_kv(js, subjects.KV_STREAMS, replicas=replicas)
    await ensure_kv(js, subjects.KV_WEIGHTS, replicas=replicas)


async def ensure_kv(
    js: JetStreamContext, bucket: str, ttl: float | None = None, history: int = 1, replicas: int | None = None
) -> KeyValue:
    """The bucket, created if missing; a changed ``ttl`` or replica count (``LOOM_JS_REPLICAS`` unless given)
    applies to an existing bucket in place, its keys kept."""
    replicas = js_replicas() if replicas is None else replicas
    try:
        kv = await js.key_value(bucket)
    except Exception:  # bucket missing: create it (NotFoundError or BucketNotFoundError by version)
        cfg = KeyValueConfig(
            bucket=bucket, history=history, ttl=ttl, storage=StorageType.FILE, replicas=replicas
        )
        try:
            return await js.create_key_value(config=cfg)
        except BadRequestError:
            return await js.key_value(bucket)  # another service won the race
    info = (await kv.status()).stream_info
    changes: dict[str, Any] = {}
    if ttl is not None and info.config.max_age != ttl:  # a changed retention applies at the next start
        changes["max_age"] = ttl
    if (info.config.num_replicas or 1) != replicas:
        changes["num_replicas"] = replicas
    if changes:
        await js.update_stream(config=dataclasses.replace(info.config, **changes))
    return kv


def kv_key(*parts: str) -> str:
    return ".".join(parts)


async def kv_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """The bucket's keys, read from its stream's subjects (a bucket ``b`` is stream ``KV_b`` over
    ``$KV.b.<key>``, ADR-8). Never nats-py's ``KeyValue.keys()``: that reads a watch until one message says
    nothing is pending, and while the bucket is written it returned no keys, or some, about one time in 18
    (a standby taking over would have reloaded half the jobs). A deleted key is listed; its read fails."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=prefix + ">")
    return [s[len(prefix) :] for s in info.state.subjects or {}]


async def open_kv(js: JetStreamContext, bucket: str) -> KeyValue:
    """An existing bucket, opened through the streams' elections (a service taking over while a nats-server
    died opens its buckets then)."""
    return await through_failover(functools.partial(js.key_value, bucket))


async def kv_values(js: JetStreamContext, kv: KeyValue, bucket: str) -> list[bytes]:
    """The value of every entry of ``kv`` (the bucket named ``bucket``), read through the streams' elections;
    deleted and empty entries are left out. What a service reloads its records from."""
    out = []
    for k in await through_failover(functools.partial(kv_keys, js, bucket)):
        try:
            entry = await through_failover(functools.partial(kv.get, k))
        except KeyNotFoundError:
            continue
        if entry.value:
            out.append(entry.value)
    return out

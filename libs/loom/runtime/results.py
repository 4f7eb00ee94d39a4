"""The job result stream (the sample buffer): scored trajectories, one message per trajectory.

Idempotency: each result is published with ``Nats-Msg-Id = <job>.<traj>``, and headers carry what
services need to rebuild their state without decoding whole trajectories (a headers-only scan).

A record that does not decode (or whose headers do not parse) is skipped with a logged error and reported to
the reader's ``on_bad``: one bad message never hides the results after it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from loom.protocol import DecodeError, Trajectory, decode, encode, subjects

log = logging.getLogger(__name__)
# Told of each skipped record: its stream sequence and why.
OnBad = Callable[[int, str], None]

H_TRAJ = "Loom-Traj-Id"
H_TASK = "Loom-Task-Id"
H_STATUS = "Loom-Status"
H_TOKENS = "Loom-Output-Tokens"
H_REWARD = "Loom-Reward"
H_GROUP = "Loom-Group"
H_START = "Loom-Start-Version"
H_FINISH = "Loom-Finish"


@dataclass(frozen=True)
class ResultHeader:
    seq: int
    job_id: str
    traj_id: str
    task_id: str
    status: str
    output_tokens: int
    reward: float | None
    group: int = -1
    start_version: int | None = None
    finish_reason: str = ""


def msg_id(job_id: str, traj_id: str) -> str:
    return f"{job_id}.{traj_id}"


def cause(finish_reason: str) -> str:
    """A finish reason as far as a result's header carries it: what tells two failures' causes apart."""
    return finish_reason[:120].replace("\r", " ").replace("\n", " ")


async def publish_result(js: JetStreamContext, traj: Trajectory) -> bool:
    """Store a scored trajectory; returns False when it was already stored (a duplicate)."""
    headers = {
        "Nats-Msg-Id": msg_id(traj.job_id, traj.traj_id),
        H_TRAJ: traj.traj_id,
        H_TASK: traj.task_id,
        H_STATUS: traj.status,
        H_TOKENS: str(traj.output_tokens),
        H_REWARD: "" if traj.reward is None else repr(traj.reward),
        H_GROUP: str(traj.group),
        H_START: "" if traj.start_version is None else str(traj.start_version),
        # Why it ended, as far as a header may carry it (stale and redundant aborts are told apart by it).
        H_FINISH: cause(traj.finish_reason),
    }
    ack = await js.publish(subjects.results(traj.job_id), encode(traj), headers=headers)
    return not ack.duplicate


async def count_results(js: JetStreamContext, job_id: str) -> int:
    info = await js.stream_info(subjects.STREAM_RESULTS, subjects_filter=subjects.results(job_id))
    return sum((info.state.subjects or {}).values())


def _skip(job_id: str, seq: int, why: str, on_bad: OnBad | None) -> None:
    log.error("result %d of job %s is unreadable and skipped: %s", seq, job_id, why)
    if on_bad is not None:
        on_bad(seq, why)


async def page_results(
    js: JetStreamContext, job_id: str, after_seq: int = 0, limit: int = 100, on_bad: OnBad | None = None
) -> tuple[list[tuple[int, Trajectory]], int, bool]:
    """Up to ``limit`` results with stream sequence > ``after_seq``: them, the next cursor (past any record
    skipped), and whether the stream has nothing after it."""
    out: list[tuple[int, Trajectory]] = []
    seq = after_seq + 1
    subj = subjects.results(job_id)
    while len(out) < limit:
        try:
            m = await js.get_msg(subjects.STREAM_RESULTS, seq=seq, subject=subj, next=True)
        except NotFoundError:
            return out, seq - 1, True
        assert m.seq is not None
        seq = m.seq + 1
        try:
            out.append((m.seq, decode(m.data or b"", Trajectory)))
        except DecodeError as e:
            _skip(job_id, m.seq, str(e), on_bad)
    return out, seq - 1, False


async def iter_results(
    js: JetStreamContext, job_id: str, page: int = 100, on_bad: OnBad | None = None
) -> AsyncIterator[Trajectory]:
    cursor, end = 0, False
    while not end:
        items, cursor, end = await page_results(js, job_id, cursor, page, on_bad)
        for _, t in items:
            yield t


def header_of(subject: str, seq: int, h: dict[str, str]) -> ResultHeader:
    reward, start = h.get(H_REWARD, ""), h.get(H_START, "")
    return ResultHeader(
        seq=seq,
        job_id=subject.rsplit(".", 1)[-1],
        traj_id=h.get(H_TRAJ, ""),
        task_id=h.get(H_TASK, ""),
        status=h.get(H_STATUS, ""),
        output_tokens=int(h.get(H_TOKENS, "0") or 0),
        reward=float(reward) if reward else None,
        group=int(h.get(H_GROUP, "-1") or -1),
        start_version=int(start) if start else None,
        finish_reason=h.get(H_FINISH, ""),
    )


async def scan_headers(js: JetStreamContext, job_id: str = "*") -> list[ResultHeader]:
    """Every stored result's headers (no payloads): cheap enough to rebuild counters after a restart."""
    subj = subjects.results(job_id)
    info = await js.stream_info(subjects.STREAM_RESULTS, subjects_filter=subj)
    total = sum((info.state.subjects or {}).values())
    if total == 0:
        return []
    cfg = ConsumerConfig(
        headers_only=True,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
    )
    sub = await js.pull_subscribe(subj, stream=subjects.STREAM_RESULTS, config=cfg)
    out: list[ResultHeader] = []
    try:
        while len(out) < total:
            msgs = await sub.fetch(min(1000, total - len(out)), timeout=5)
            for m in msgs:
                try:
                    h = header_of(m.subject, m.metadata.sequence.stream, m.headers or {})
                    if not h.traj_id:
                        raise ValueError("no trajectory id")
                    out.append(h)
                except ValueError as e:
                    _skip(job_id, m.metadata.sequence.stream, f"bad headers: {e}", None)
                    total -= 1
            if msgs and msgs[-1].metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out

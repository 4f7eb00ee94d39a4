"""NATS as the edge review attacked it (finding 2), with the users ``loom up`` and compose configure: no
anonymous client connects, and the forgeries a scoped or wrong user tries are refused by the server, which
logs each; the services' own traffic still flows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from loom.identity import nats_auth
from loom.protocol import CancelJob, TrajDone, decode, encode, subjects
from loom.runtime import bus
from loom.runtime.natsserver import NatsServer, refusals


@dataclass
class AuthServer:
    url: str
    passwords: dict[str, str]
    log: Path

    async def connect(self, role: str) -> NATS:
        errors: list[Exception] = []

        async def on_error(e: Exception) -> None:
            errors.append(e)

        nc = await nats.connect(
            self.url,
            user=role,
            password=self.passwords[role],
            inbox_prefix=bus.inbox_prefix(role),
            error_cb=on_error,
            max_reconnect_attempts=0,
        )
        nc._test_errors = errors  # type: ignore[attr-defined]
        return nc

    def violations(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if " Violation - Subject " in line]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[AuthServer]:
    passwords = nats_auth.passwords(tmp_path / "users")
    srv = NatsServer(tmp_path / "nats", authorization=nats_auth.authorization(passwords))
    url = await srv.start()
    try:
        yield AuthServer(url, passwords, tmp_path / "nats" / "nats-server.log")
    finally:
        await srv.stop()


async def test_anonymous_and_wrong_passwords_are_refused(server: AuthServer) -> None:
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(server.url, max_reconnect_attempts=0, connect_timeout=3, allow_reconnect=False)
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(
            server.url, user="scheduler", password="guess", max_reconnect_attempts=0, allow_reconnect=False
        )
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(
            server.url.replace("nats://", f"nats://trainer:{server.passwords['scheduler']}@"),
            max_reconnect_attempts=0,
            allow_reconnect=False,
        )
    assert refusals(server.log) == {"publish": 0, "subscribe": 0, "authentication": 3}


async def _heard(nc: NATS, subject: str) -> list[bytes]:
    """What ``nc`` hears on ``subject`` from now on."""
    got: list[bytes] = []

    async def keep(msg: Msg) -> None:
        got.append(msg.data)

    await nc.subscribe(subject, cb=keep)
    await nc.flush()
    return got


async def test_a_trainer_cannot_forge_what_the_services_own(server: AuthServer) -> None:
    scheduler = await server.connect("scheduler")
    router = await server.connect("router")
    envmgr = await server.connect("envmgr")
    trainer = await server.connect(nats_auth.TRAINER)
    try:
        await bus.ensure_streams(scheduler.jetstream())
        cancels = await _heard(envmgr, subjects.CONTROL_CANCEL)
        done = await _heard(scheduler, subjects.TRAJ_DONE_ALL)
        # A trainer listening to everything hears nothing (its subscription is refused).
        snooped = await _heard(trainer, f"{subjects.PREFIX}.>")

        await trainer.publish(subjects.CONTROL_CANCEL, encode(CancelJob("job-1")))
        await trainer.publish(subjects.traj_done("job-1"), encode(TrajDone("job-1", "t0", "ok", 1.0, 10, 1)))
        forged = {"job_id": "job-1", "traj_id": "t0", "reward": 1.0}
        await trainer.publish(
            subjects.results("job-1"), msgspec.json.encode(forged), headers={"Nats-Msg-Id": "job-1.t0"}
        )
        await trainer.publish("$KV.loom_workers.fake", b"{}")
        await trainer.flush()
        # The real owners' messages get through.
        await scheduler.publish(subjects.CONTROL_CANCEL, encode(CancelJob("job-2")))
        await scheduler.flush()
        await asyncio.sleep(0.5)

        assert [decode(c, CancelJob).job_id for c in cancels] == ["job-2"]
        assert done == []
        assert [m for m in snooped if b"job-2" in m] == []
        info = await scheduler.jetstream().stream_info(subjects.STREAM_RESULTS)
        assert info.state.messages == 0
        with pytest.raises(Exception):  # noqa: B017 - whatever nats-py raises for "no such key"
            await (await scheduler.jetstream().key_value(subjects.KV_WORKERS)).get("fake")
        assert router.is_connected and trainer.is_connected  # a refusal is not a disconnect
        log = "\n".join(server.violations())
        for subject in (
            subjects.CONTROL_CANCEL,
            subjects.traj_done("job-1"),
            subjects.results("job-1"),
            "$KV.loom_workers.fake",
            f"{subjects.PREFIX}.>",
        ):
            assert f'"{subject}"' in log, (subject, log)
    finally:
        for nc in (scheduler, router, envmgr, trainer):
            await nc.close()


async def test_each_service_is_held_to_its_role(server: AuthServer) -> None:
    """Wrongly scoped: a predictor may not publish results or cancels, a rollout worker may not ask for
    generations, and no role may read another's inbox."""
    predictor = await server.connect("predictor")
    rollout = await server.connect("rollout")
    reward = await server.connect("reward")
    try:
        await predictor.publish(subjects.results("job-1"), b"{}")
        await predictor.publish(subjects.CONTROL_CANCEL, b"{}")
        await rollout.publish(subjects.GEN_REQUEST, b"{}")
        await rollout.subscribe(f"{bus.inbox_prefix('envmgr')}.>")
        await reward.publish(subjects.results("job-1"), b"{}")  # the reward role owns results
        for nc in (predictor, rollout, reward):
            await nc.flush()
        await asyncio.sleep(0.3)
        log = server.violations()
        assert len(log) == 4, log
        assert refusals(server.log) == {"publish": 3, "subscribe": 1, "authentication": 0}
        assert any("user:predictor" in v and subjects.results("job-1") in v for v in log)
        assert any("user:predictor" in v and subjects.CONTROL_CANCEL in v for v in log)
        assert any("user:rollout" in v and "Publish" in v and subjects.GEN_REQUEST in v for v in log)
        assert any("user:rollout" in v and "Subscription" in v and "_INBOX_envmgr.>" in v for v in log)
    finally:
        for nc in (predictor, rollout, reward):
            await nc.close()


def test_every_role_has_a_password_and_they_are_kept(tmp_path: Path) -> None:
    a = nats_auth.passwords(tmp_path)
    assert set(a) == set(nats_auth.ROLES) and len(set(a.values())) == len(a)
    assert nats_auth.passwords(tmp_path) == a
    assert (tmp_path / nats_auth.USERS_FILE).stat().st_mode & 0o777 == 0o600

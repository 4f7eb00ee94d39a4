"""NATS users and what each may do: one user per service role, scoped users for what connects from outside.

With these users in nats-server's configuration no anonymous client connects, and each role may publish
and subscribe only where its part of the system needs (the subjects are in ``loom.protocol.subjects``):

- results (``loom.v1.results.>``) and trajectory events come only from the reward role, which scores them;
- cancels, placements and version bumps only from the scheduler; worker registrations (KV ``loom_workers``)
  only from rollout workers; generation results only from the router and the rollout workers;
- ``trainer`` (the trainer SDK, ``loom train``, RollMux phase clients) asks the scheduler for streams and
  phase permits and reads its stream's samples, and nothing else: it cannot cancel a job, publish a result
  or register a worker;
- ``operator`` (``loom status``, health checks) asks services for their health and metrics.

Every role's replies arrive under its own inbox prefix (``loom.runtime.bus.inbox_prefix``), the only inboxes it may
subscribe to. The router and rollout workers send a generation's results to the caller's inbox named in
the request, so they may publish to the environment manager's and the reward service's inboxes.

Internal services may use the whole JetStream API: each makes sure the streams and buckets exist when it
starts. A compromised service is therefore trusted with the streams; the users keep out strangers and
bound what the outside integrations and each service's subjects can do.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from loom.protocol import subjects
from loom.runtime.bus import inbox_prefix
from loom.runtime.natsserver import container_config

SERVICES = subjects.SERVICES
TRAINER = "trainer"
OPERATOR = "operator"
ROLES = (*SERVICES, TRAINER, OPERATOR)
USERS_FILE = "users.json"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def _kv(*buckets: str) -> tuple[str, ...]:
    return tuple(f"$KV.{b}.>" for b in buckets)


def _lease(service: str) -> str:
    """The one key of the lease bucket a service writes: its own lease (loom.runtime.lease), no other's."""
    return f"$KV.{subjects.KV_LEASES}.{service}"


def _service(role: str, publish: tuple[str, ...], subscribe: tuple[str, ...]) -> Permissions:
    return Permissions(
        publish=(
            "$JS.API.>",
            "$JS.ACK.>",
            "$JS.FC.>",
            subjects.dead_letter(role),
            subjects.health("*"),  # the container healthcheck runs as the service it checks
            *_answers(OPERATOR, role),  # health and metrics answers
            *publish,
        ),
        subscribe=(
            subjects.health(role),
            subjects.metrics(role),
            f"{inbox_prefix(role)}.>",
            *subscribe,
        ),
    )


# What trainers ask the scheduler for: rollout streams and RollMux phase permits.
TRAINER_REQUESTS = (
    subjects.STREAM_CREATE,
    subjects.STREAM_GET,
    subjects.STREAM_CANCEL,
    subjects.STREAM_LEASE,
    subjects.STREAM_TAKEN,
    subjects.STREAM_WEIGHTS,
    subjects.PHASE_REQUEST,
    subjects.PHASE_DONE,
    subjects.PHASE_PROGRESS,
)
# Where generation results go: the inboxes of the roles that ask for generations.
GEN_CALLERS = (f"{inbox_prefix('envmgr')}.>", f"{inbox_prefix('reward')}.>")


def _answers(*callers: str) -> tuple[str, ...]:
    """The inboxes of the roles whose requests a role answers. allow_responses alone is not enough on a
    cluster: it is kept by the server that delivered the request, and a responder whose server died
    meanwhile answers through another, which would refuse the reply."""
    return tuple(f"{inbox_prefix(c)}.>" for c in callers)


PERMISSIONS: dict[str, Permissions] = {
    "scheduler": _service(
        "scheduler",
        (
            subjects.CONTROL_CANCEL,
            subjects.CONTROL_PLACEMENT,
            subjects.CONTROL_VERSION,
            subjects.CONTROL_GROUP_RESTART,
            subjects.GEN_ABORT,
            subjects.PREDICT,
            subjects.phase_permit("*"),
            subjects.tail_migration("*"),
            subjects.worker_weights("*"),
            subjects.SESSION_ALL,
            *subjects.STREAM_TRAJWORK_SUBJECTS,
            *subjects.STREAM_SAMPLES_SUBJECTS,
            *_answers(TRAINER),
            _lease("scheduler"),
            *_kv(
                subjects.KV_JOBS,
                subjects.KV_TRAJ,
                subjects.KV_STREAMS,
                subjects.KV_GROUPS,
                subjects.KV_WEIGHTS,
                subjects.KV_RLJOBS,
            ),
        ),
        (
            subjects.TRAJ_DONE_ALL,
            subjects.CONTROL_CANCEL,
            # What the dashboard shows: worker loads, finished calls, predictions.
            subjects.TELEMETRY_WORKERS,
            subjects.WORKER_DONE_ALL,
            subjects.CONTROL_PRIORITY,
            *TRAINER_REQUESTS,
        ),
    ),
    "router": _service(
        "router",
        (
            subjects.worker_gen("*"),
            subjects.worker_abort("*"),
            subjects.worker_warm("*"),
            *GEN_CALLERS,
            _lease("router"),
            *_kv(subjects.KV_TRAJ),
        ),
        (
            subjects.GEN_REQUEST,
            subjects.GEN_ABORT,
            subjects.CONTROL_CANCEL,
            subjects.CONTROL_PRIORITY,
            subjects.CONTROL_PLACEMENT,
            subjects.WORKER_DONE_ALL,
            subjects.TELEMETRY_WORKERS,
            subjects.TRAJ_DONE_ALL,
        ),
    ),
    "rollout": _service(
        "rollout",
        (
            subjects.TELEMETRY_WORKERS,
            subjects.WORKER_DONE_ALL,
            *GEN_CALLERS,
            *_answers("router", "scheduler"),  # prefix warm-ups, weight updates
            *_kv(subjects.KV_WORKERS),
        ),
        (
            subjects.worker_gen("*"),
            subjects.worker_abort("*"),
            subjects.worker_warm("*"),
            subjects.worker_weights("*"),
        ),
    ),
    "predictor": _service(
        "predictor",
        (subjects.CONTROL_PRIORITY, *_answers("envmgr", "scheduler")),
        (subjects.TRAJ_DONE_ALL, subjects.PREDICT),
    ),
    "envmgr": _service(
        "envmgr",
        (
            subjects.GEN_REQUEST,
            subjects.GEN_ABORT,
            subjects.CONTROL_PRIORITY,
            subjects.CONTROL_GROUP_DONE,
            subjects.PREDICT,
            # Answers to the gateway's calls on sessions, which may come later than allow_responses lasts.
            f"{inbox_prefix('scheduler')}.>",
            *subjects.STREAM_REWARD_SUBJECTS,
            *_kv(subjects.KV_GROUPS),
        ),
        (
            subjects.CONTROL_CANCEL,
            subjects.CONTROL_GROUP_DONE,
            subjects.CONTROL_GROUP_RESTART,
            subjects.CONTROL_VERSION,
            subjects.SESSION_ALL,
        ),
    ),
    "reward": _service(
        "reward",
        (
            subjects.reward_worker("*"),
            subjects.REWARD_READY,
            subjects.TRAJ_DONE_ALL,
            *subjects.STREAM_RESULTS_SUBJECTS,
            subjects.GEN_REQUEST,  # the judge reward asks an engine
            subjects.GEN_ABORT,
            *_kv(subjects.KV_TRAJ),
        ),
        (subjects.REWARD_READY, subjects.reward_worker("*")),
    ),
    TRAINER: Permissions(
        publish=(
            *TRAINER_REQUESTS,
            # Its stream's sample buffer: a durable consumer on LOOM_SAMPLES, and the results it points to.
            f"$JS.API.CONSUMER.INFO.{subjects.STREAM_SAMPLES}.>",
            f"$JS.API.CONSUMER.CREATE.{subjects.STREAM_SAMPLES}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{subjects.STREAM_SAMPLES}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{subjects.STREAM_SAMPLES}.>",
            f"$JS.API.CONSUMER.DELETE.{subjects.STREAM_SAMPLES}.>",
            f"$JS.ACK.{subjects.STREAM_SAMPLES}.>",
            f"$JS.API.STREAM.MSG.GET.{subjects.STREAM_RESULTS}",
            # Publishing weights versions to the object store (loom.weights.store): create it, put chunks
            # and metadata, read an object's metadata, purge (delete) old versions.
            *(
                f"$JS.API.STREAM.{op}.OBJ_{subjects.OBJ_WEIGHTS}"
                for op in ("INFO", "CREATE", "PURGE", "MSG.GET")
            ),
            f"$JS.API.DIRECT.GET.OBJ_{subjects.OBJ_WEIGHTS}.>",
            f"$O.{subjects.OBJ_WEIGHTS}.>",
        ),
        subscribe=(
            f"{inbox_prefix(TRAINER)}.>",
            subjects.phase_permit("*"),
            subjects.tail_migration("*"),
        ),
    ),
    OPERATOR: Permissions(
        # Health, metrics, and how the streams stand (their replicas and leaders on a cluster): read only.
        publish=(subjects.health("*"), subjects.metrics("*"), "$JS.API.INFO", "$JS.API.STREAM.INFO.*"),
        subscribe=(f"{inbox_prefix(OPERATOR)}.>",),
    ),
}


def authorization(passwords: Mapping[str, str]) -> str:
    """nats-server's ``authorization`` block for these users (every role in ``passwords``)."""
    users = []
    for role, pw in passwords.items():
        perms = PERMISSIONS[role]
        users.append(
            {
                "user": role,
                "password": pw,
                "permissions": {
                    "publish": {"allow": list(perms.publish)},
                    "subscribe": {"allow": list(perms.subscribe)},
                    # Replies to requests the role received (health, predictions, permits, ...).
                    "allow_responses": {"max": 1, "expires": "5m"},
                },
            }
        )
    # nats-server's configuration format reads JSON objects and arrays.
    return f"authorization {{\n  users = {json.dumps(users, indent=2)}\n}}\n"


def stored(directory: Path) -> dict[str, str]:
    """The passwords kept in ``directory`` (none where it has no users file)."""
    path = directory / USERS_FILE
    return dict(json.loads(path.read_text())) if path.exists() else {}


def passwords(directory: Path) -> dict[str, str]:
    """Every role's password, made on first use and kept in ``directory`` (mode 600)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / USERS_FILE
    known = stored(directory)
    if set(ROLES) - set(known):
        known = {r: known.get(r) or secrets.token_urlsafe(24) for r in ROLES}
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        tmp.replace(path)
    return {r: known[r] for r in ROLES}


def role_env(role: str, password: str) -> dict[str, str]:
    """What a service process needs in its environment to connect as ``role``."""
    return {"LOOM_NATS_USER": role, "LOOM_NATS_PASSWORD": password}


# compose.yaml: the user each service's container runs as (all in group loom, 10001), so that each reads
# its own password file and no other. The environment manager and the reward service run as root (they
# drive the engine through its socket); the NATS server reads its configuration as 10002.
COMPOSE_UIDS = {"scheduler": 10011, "router": 10012, "rollout": 10013, "predictor": 10014}
ROOT_ROLES = ("envmgr", "reward", TRAINER, OPERATOR)
NATS_UID = 10002
NATS_CONFIG = "nats.conf"


def write_compose_secrets(directory: Path) -> None:
    """The users of a compose deployment, made once into its secrets volume: nats-server's configuration
    (its users, readable by the server alone) and each role's password in ``<role>.password``, readable
    by that role's container user alone (the trainer's and operator's by root)."""
    pw = passwords(directory)
    conf = directory / NATS_CONFIG
    conf.write_text(container_config() + authorization(pw))
    os.chown(conf, NATS_UID, NATS_UID)
    conf.chmod(0o400)
    os.chown(directory / USERS_FILE, 0, 0)
    for role in ROLES:
        f = directory / f"{role}.password"
        f.write_text(pw[role])
        uid = COMPOSE_UIDS.get(role, 0)
        os.chown(f, uid, 0)
        f.chmod(0o400)
    directory.chmod(0o755)


def main(argv: list[str]) -> int:
    """``compose DIR``: a compose deployment's secrets; ``authorization DIR``: print the ``authorization`` block
    for the passwords kept in DIR (made there first if missing), for a NATS cluster of your own: every server
    takes the same block, and each service its role's password from DIR/users.json."""
    if len(argv) != 2 or argv[0] not in ("compose", "authorization"):
        print("usage: python3 -m loom.identity.nats_auth {compose|authorization} DIRECTORY", file=sys.stderr)
        return 2
    if argv[0] == "compose":
        write_compose_secrets(Path(argv[1]))
    else:
        print(authorization(passwords(Path(argv[1]))), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

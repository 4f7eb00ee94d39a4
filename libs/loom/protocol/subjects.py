"""Every NATS subject, stream and bucket name Loom uses. Versioned under ``loom.v1``."""

from __future__ import annotations

PREFIX = "loom.v1"

SERVICES = ("scheduler", "router", "rollout", "predictor", "envmgr", "reward")


def health(service: str) -> str:
    return f"{PREFIX}.health.{service}"


def metrics(service: str) -> str:
    return f"{PREFIX}.metrics.{service}"


# Generation path: envmgr -> router (queue group) -> worker, replies go straight to the caller's inbox.
GEN_REQUEST = f"{PREFIX}.gen.request"
GEN_ABORT = f"{PREFIX}.gen.abort"


def worker_gen(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.gen"


def worker_abort(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.abort"


def worker_warm(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.warm"


def worker_weights(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.weights"


def worker_done(worker_id: str) -> str:
    return f"{PREFIX}.worker.{worker_id}.done"


WORKER_DONE_ALL = f"{PREFIX}.worker.*.done"


def telemetry(kind: str, ident: str) -> str:
    return f"{PREFIX}.telemetry.{kind}.{ident}"


TELEMETRY_WORKERS = f"{PREFIX}.telemetry.worker.*"

PREDICT = f"{PREFIX}.predict"


def control(kind: str) -> str:
    return f"{PREFIX}.control.{kind}"


CONTROL_PRIORITY = control("priority")
CONTROL_PLACEMENT = control("placement")
CONTROL_CANCEL = control("cancel")
CONTROL_GROUP_DONE = control("group_done")
CONTROL_GROUP_RESTART = control("group_restart")
CONTROL_VERSION = control("version")


# Trajectory work (the LOOM_TRAJWORK work queue) goes by lanes. Most environments run in any environment
# manager: the main lane, ``trajwork.<job>``. A library whose pins cannot share the main virtualenv (GEM's
# antlr4 4.13 against hydra's 4.9) runs only in managers started from a virtualenv of its own: its
# trajectories take a lane of their own, ``trajwork.<job>.<lane>``, which only those managers consume. The
# consumers' filters must not overlap on a work-queue stream, and ``*`` against ``*.<lane>`` do not.
# Which environment goes to which lane is the environment table's (loom.envs.registry: Resolved.lane, LANES).
MAIN_LANE = "main"


def traj_work(job_id: str, lane: str = MAIN_LANE) -> str:
    return f"{PREFIX}.trajwork.{job_id}" if lane == MAIN_LANE else f"{PREFIX}.trajwork.{job_id}.{lane}"


def traj_work_lanes(job_id: str) -> str:
    """The work of a job in every library lane (to purge it with; ``traj_work(job_id)`` is the main lane's)."""
    return f"{PREFIX}.trajwork.{job_id}.>"


def traj_work_filter(lane: str) -> str:
    """What the consumers of ``lane`` take: one lane's work of every job."""
    return f"{PREFIX}.trajwork.*" if lane == MAIN_LANE else f"{PREFIX}.trajwork.*.{lane}"


# Reward work: one subject per tenant and job; each tenant has its own pull consumer (weighted fair share).
def reward_submit(tenant: str, job_id: str) -> str:
    return f"{PREFIX}.reward.submit.{tenant}.{job_id}"


def reward_tenant(tenant: str) -> str:
    return f"{PREFIX}.reward.submit.{tenant}.>"


def tenant_of_reward_subject(subject: str) -> str:
    return subject.split(".")[4]


def reward_worker(worker_id: str) -> str:
    return f"{PREFIX}.reward.worker.{worker_id}"


REWARD_READY = f"{PREFIX}.reward.ready"


def results(job_id: str) -> str:
    return f"{PREFIX}.results.{job_id}"


def traj_done(job_id: str) -> str:
    return f"{PREFIX}.events.trajdone.{job_id}"


TRAJ_DONE_ALL = f"{PREFIX}.events.trajdone.*"


# An external agent's calls to its session (the OpenAI-compatible gateway), answered by the environment
# manager running the trajectory; nobody answers before it has started or after it ended.
def session(job_id: str, traj_id: str) -> str:
    return f"{PREFIX}.session.{job_id}.{traj_id}"


SESSION_ALL = f"{PREFIX}.session.*.*"


def dead_letter(service: str) -> str:
    return f"{PREFIX}.dlq.{service}"


# JetStream streams (durable) and their subject spaces.
STREAM_TRAJWORK = "LOOM_TRAJWORK"
STREAM_TRAJWORK_SUBJECTS = [f"{PREFIX}.trajwork.>"]
STREAM_REWARD = "LOOM_REWARD"
STREAM_REWARD_SUBJECTS = [f"{PREFIX}.reward.submit.>"]
STREAM_RESULTS = "LOOM_RESULTS"
STREAM_RESULTS_SUBJECTS = [f"{PREFIX}.results.>"]
STREAM_DLQ = "LOOM_DLQ"
STREAM_DLQ_SUBJECTS = [f"{PREFIX}.dlq.>"]

# Rollout streams: the trainer SDK's requests to the scheduler (request/reply), and each stream's sample buffer.
STREAM_CREATE = f"{PREFIX}.streams.create"
STREAM_GET = f"{PREFIX}.streams.get"
STREAM_CANCEL = f"{PREFIX}.streams.cancel"
STREAM_LEASE = f"{PREFIX}.streams.lease"
STREAM_TAKEN = f"{PREFIX}.streams.taken"
STREAM_WEIGHTS = f"{PREFIX}.streams.weights"


def samples(stream_id: str) -> str:
    return f"{PREFIX}.samples.{stream_id}"


STREAM_SAMPLES = "LOOM_SAMPLES"
STREAM_SAMPLES_SUBJECTS = [f"{PREFIX}.samples.>"]

# RollMux phase permits: trainers ask (request/reply), the scheduler answers on each job's permit subject.
PHASE_REQUEST = f"{PREFIX}.rollmux.request"
PHASE_DONE = f"{PREFIX}.rollmux.done"
PHASE_PROGRESS = f"{PREFIX}.rollmux.progress"


def phase_permit(job: str) -> str:
    return f"{PREFIX}.rollmux.permit.{job}"


def tail_migration(job: str) -> str:
    return f"{PREFIX}.rollmux.migrate.{job}"


# KV buckets.
KV_JOBS = "loom_jobs"
KV_TRAJ = "loom_traj"
# Per group: the trajectories kept so far (redundant rollouts stop at group_size), key <job>.<group>.
KV_GROUPS = "loom_groups"


def group_restarted_key(job_id: str, group: int) -> str:
    """KV ``loom_groups``: present once a stream's group was restarted."""
    return f"{job_id}.{group}.restarted"


KV_WORKERS = "loom_workers"
KV_RLJOBS = "loom_rljobs"
KV_STREAMS = "loom_streams"  # rollout streams (loom.protocol.Stream), key = stream id
# Leases of the services one instance of which acts at a time (loom.runtime.lease), key = the service.
KV_LEASES = "loom_leases"
# Weights versions published by trainers (loom.weights.store): a JetStream object store, chunks on $O.<bucket>.
OBJ_WEIGHTS = "loom_weights_store"
KV_WEIGHTS = "loom_weights"  # the weights each model's fleet serves (FleetWeights), key = model  # co-scheduled RL job specs, replayed in order on restart

QUEUE_GROUP = "loom"

"""Wire types. msgpack on NATS, JSON at the REST edge; both decode strictly into these structs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

NonNeg = Annotated[int, Meta(ge=0)]
Pos = Annotated[int, Meta(ge=1)]
NonNegF = Annotated[float, Meta(ge=0.0)]
# Job and trajectory ids become NATS subject tokens and KV keys: keep them to a safe alphabet.
Ident = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]

# ---------------------------------------------------------------- jobs (REST edge and durable store)


class TaskSpec(Struct, forbid_unknown_fields=True):
    """One prompt. ``data`` is environment-specific (for ``replay``: ``{"trace_id": ...}``)."""

    id: Annotated[str, Meta(min_length=1, max_length=256)]
    data: dict[str, Any] = {}


# Built-in reward functions (loom.rewards.registry implements exactly these); others are ``module:fn``.
BUILTIN_REWARDS = ("replay", "env", "math", "code", "judge")
Tenant = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
AffinityGpu = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,32}$")]
# A built-in environment, an agent outside Loom ("external", through the OpenAI-compatible gateway), a
# library's environment ``<prefix>:<name>`` (``reasoning_gym:chain_sum``), or an environment class by import
# path ``module:Class`` (loom.envs.api) from a module the operator allowed (loom.envs.registry resolves it).
EnvName = Annotated[
    str,
    # A library's names may hold more colons, dots and dashes (GEM's ``gem:game:GuessTheNumber-v0-easy``).
    Meta(
        pattern=r"^(replay|code|math|search|coin|external|[A-Za-z_][\w.]*:[A-Za-z_][\w.:-]*)$", max_length=256
    ),
]
RewardName = Annotated[str, Meta(pattern=r"^([a-z_]+|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$", max_length=256)]


class DatasetRef(Struct, forbid_unknown_fields=True):
    """Tasks taken from a named data set instead of listed inline. No name: the environment's own tasks (its
    default set; a library environment's generated tasks; replay's default traces)."""

    name: (
        Literal[
            "swe-replay",
            "humaneval",
            "mbpp",
            "gsm8k",
            "gsm8k-train",
            "hotpotqa",
            "arith",
            "arith-eval",
            "coin",
            "coin-eval",
            "jsonl",
        ]
        | None
    ) = None
    # Where the set's file is; a "jsonl" set (one task per line: a JSON object, its "id" optional) needs it.
    path: str | None = None
    offset: NonNeg = 0
    limit: Annotated[int, Meta(ge=1, le=100_000)] | None = None
    # swe-replay: each sample of a group a variation of the recorded run ("varied", loom.envs.replay), or
    # the recorded run itself ("replay"). A replay task's data may say the same per task.
    siblings: Literal["varied", "replay"] = "varied"


class ToolLatency(Struct, forbid_unknown_fields=True):
    """Modelled tool-call latency (simulated seconds): log-normal with this mean and shape."""

    mean_s: NonNegF = 0.43
    sigma: Annotated[float, Meta(ge=0.0, le=4.0)] = 0.8


class SamplingParams(Struct, forbid_unknown_fields=True):
    """How the engine samples each turn (SGLang's sampling_params of the same names)."""

    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    # Record the log-probability of every generated token: what an importance-weighted trainer needs, so on
    # unless a job turns it off (verl, slime and AReaL keep the rollout's log-probs too).
    logprobs: bool = True
    # Each model call samples from a seed of its own, drawn from the job's seed and the call's place (group,
    # sample, turn), not from the engine's stream: a rerun of the job samples the same tokens wherever the
    # engine's arithmetic repeats, and two jobs of one seed (say the evaluations before and after training)
    # share their draws. vLLM's per-request ``seed`` (slower there: a generator per request), SGLang's
    # ``sampling_seed`` (under --enable-deterministic-inference).
    seeded: bool = False


Preset = Literal["heddle", "verl", "verl_star", "slime", "sglang", "round_robin"]
Order = Literal["fcfs", "rr", "pps", "autellix"]
PlacementKind = Literal["presorted_dp", "round_robin", "verl", "verl_star", "slime", "sglang_cache_aware"]
ResourceKind = Literal["adaptive", "fixed"]


class PolicySpec(Struct, forbid_unknown_fields=True):
    """A named system's policies, each part overridable (e.g. ``{"preset": "heddle", "order": "fcfs"}``).

    when (queue order), where (placement and migration), how (model-parallel resources; used where Loom
    sizes the workers, i.e. the benchmark harness; live workers are given)."""

    preset: Preset = "heddle"
    order: Order | None = None
    placement: PlacementKind | None = None
    migration: bool | None = None
    resources: ResourceKind | None = None
    fixed_mp: Annotated[int, Meta(ge=1, le=64)] = 1
    # Workers keep what their device KV cache evicts in host memory and load it back instead of
    # recomputing it (SGLang's hierarchical cache); where Loom sizes the workers, i.e. the harness.
    host_cache: bool | None = None

    def resolved(self) -> ResolvedPolicy:
        base = PRESETS[self.preset]
        return ResolvedPolicy(
            order=self.order or base.order,
            placement=self.placement or base.placement,
            migration=base.migration if self.migration is None else self.migration,
            resources=self.resources or base.resources,
            fixed_mp=self.fixed_mp,
            host_cache=base.host_cache if self.host_cache is None else self.host_cache,
        )


class ResolvedPolicy(Struct, frozen=True):
    order: Order
    placement: PlacementKind
    migration: bool
    resources: ResourceKind
    fixed_mp: int = 1
    host_cache: bool = False

    @property
    def static(self) -> bool:
        """Placement planned by the scheduler up front (vs chosen by the router per request)."""
        return self.placement in ("presorted_dp", "round_robin")

    @property
    def priority_cache(self) -> bool:
        """Workers keep the caches of higher-priority trajectories (Heddle's PPS, Algorithm 1 line 8)."""
        return self.order == "pps"


# The systems Loom is measured against use per-step round robin and homogeneous workers (Heddle §7), and
# SGLang's default device-only KV cache; Heddle persists the KV of preempted trajectories (Algorithm 1).
PRESETS: dict[str, ResolvedPolicy] = {
    "heddle": ResolvedPolicy("pps", "presorted_dp", True, "adaptive", host_cache=True),
    "verl": ResolvedPolicy("rr", "verl", False, "fixed"),
    "verl_star": ResolvedPolicy("rr", "verl_star", False, "fixed"),
    "slime": ResolvedPolicy("rr", "slime", False, "fixed"),
    "sglang": ResolvedPolicy("rr", "sglang_cache_aware", False, "fixed"),
    "round_robin": ResolvedPolicy("fcfs", "round_robin", False, "fixed"),
}


class JobSpec(Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(max_length=256)] = ""
    env: EnvName = "replay"
    # Keyword arguments of a user environment's constructor (loom.envs.api).
    env_params: dict[str, Any] = {}
    model: Annotated[str, Meta(min_length=1, max_length=128)] = "qwen3-8b"
    tasks: list[TaskSpec] = []
    dataset: DatasetRef | None = None
    group_size: Annotated[int, Meta(ge=1, le=1024)] = 8
    max_turns: Annotated[int, Meta(ge=1, le=10_000)] = 200
    max_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] = 40_960
    # Most tokens one call may generate (SGLang's max_new_tokens per turn); None: what is left of max_tokens.
    max_turn_tokens: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    tool_latency: ToolLatency = msgspec.field(default_factory=ToolLatency)
    policy: PolicySpec = msgspec.field(default_factory=PolicySpec)
    seed: NonNeg = 0
    # The model's actions come from the task's reference solution, the engine generating as many tokens
    # (the simulated engine returns lengths, not text); off, actions are the engine's decoded output.
    scripted: bool = False
    # Redundant environment rollouts (RollArt): this many extra samples per group are started, the first
    # group_size to finish are kept, the rest aborted with their engine requests.
    redundancy: Annotated[int, Meta(ge=0, le=1024)] = 0
    # Trajectories of this job one environment manager runs at once (None: its own capacity).
    env_concurrency: Annotated[int, Meta(ge=1, le=100_000)] | None = None
    # Wall-clock limit of one tool call in a sandbox.
    tool_timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    # An external agent's session ends, failed, when no call comes for this long (wall seconds).
    session_idle_s: Annotated[float, Meta(gt=0, le=86_400)] = 300.0
    # Who pays: reward workers are shared between tenants by weight (reward service settings).
    tenant: Tenant = "default"
    # Reward function: a built-in name or a user function by import path ``module:function``; None picks
    # the environment's own (``replay`` for trace replay, ``env`` for the verdict of code/math/search).
    reward: RewardName | None = None
    reward_params: dict[str, Any] = {}
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # A circuit breaker: when the first this-many trajectories to finish (or all, in a smaller job) all failed
    # with one cause (an environment that cannot start, a reward that cannot load), the job fails with that
    # cause instead of running every other trajectory into it. 0: never.
    fail_fast: Annotated[int, Meta(ge=0, le=100_000)] = 8
    # Hardware affinity (RollArt §4): task tag -> GPU type of the rollout workers that may run it, with
    # "default" for the rest, e.g. {"coding": "h800", "default": "h20"}. A task's tag is its data's "tag",
    # else the job's env; a type no live worker has constrains nothing (loom.policies.affinity).
    hw_affinity: dict[Annotated[str, Meta(min_length=1, max_length=64)], AffinityGpu] | None = None


JobState = Literal["pending", "running", "completed", "cancelled", "failed"]
TERMINAL_JOB_STATES = ("completed", "cancelled", "failed")


class Job(Struct):
    id: str
    spec: JobSpec
    state: JobState
    created_at: float
    n_trajectories: NonNeg
    completed: NonNeg = 0
    failed: NonNeg = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    # "stream": a rollout stream's record (its trajectories use the stream id as their job id); the
    # scheduler's stream manager owns it, and routers and environment managers read it as any job.
    kind: Literal["job", "stream"] = "job"


# ---------------------------------------------------------------- trajectories


class TrajWork(Struct):
    """A trajectory to run, as queued for the environment managers (durable work queue)."""

    job_id: str
    traj_id: str
    task: TaskSpec
    group: NonNeg
    sample: NonNeg
    env: str
    model: str
    max_turns: Pos
    max_tokens: Pos
    tool_latency: ToolLatency
    seed: NonNeg = 0
    max_turn_tokens: Pos | None = None
    scripted: bool = False
    # Samples kept per group; more than this were started when the job asked for redundancy.
    group_size: Pos = 1
    redundancy: NonNeg = 0
    env_concurrency: Pos | None = None
    tool_timeout_s: NonNegF = 10.0
    tenant: str = "default"
    reward: str = "replay"
    reward_params: dict[str, Any] = {}
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # Rollout streams: the asynchronous bound the environment manager enforces (None: a one-shot job).
    async_bound: NonNeg | None = None
    # The task's tag for hardware affinity (JobSpec.hw_affinity).
    tag: str = ""
    env_params: dict[str, Any] = {}
    session_idle_s: NonNegF = 300.0


TrajState = Literal["planned", "running", "done", "failed", "aborted"]


class TrajMeta(Struct):
    """Per-trajectory control-plane record (KV ``loom_traj``, key ``<job>.<traj>``)."""

    job_id: str
    traj_id: str
    worker_id: str | None = None
    priority: float = 0.0
    predicted_remaining: float | None = None
    state: TrajState = "planned"


class Sibling(Struct):
    """Another sample of the same call (an external agent's ``n`` > 1): the same context as its step, its own
    output. The step holds the sample the agent continued from; the trajectory's sequence never includes a
    sibling, so a trainer that reads only ``steps`` trains on the path the agent took."""

    choice: NonNeg  # its index among the call's choices
    output_len: NonNeg
    action: str = ""
    output_ids: list[int] | None = None
    output_logprobs: list[float] | None = None
    finish_reason: str = ""


class Step(Struct):
    index: NonNeg
    prompt_len: NonNeg
    output_len: NonNeg
    action: str = ""
    observation: str = ""
    worker_id: str = ""
    started_at: float = 0.0
    queue_s: NonNegF = 0.0
    gen_s: NonNegF = 0.0
    tool_s: NonNegF = 0.0
    attempts: Pos = 1
    # Token ids exactly as the engine saw and produced them (live environments with a real engine):
    # ``prompt_ids`` are the tokens added to the context before this call (the whole prompt at step 0,
    # then the observation that followed the previous output), so the context of call k is every earlier
    # step's prompt_ids + output_ids, then this step's prompt_ids. ``output_ids`` are the model's tokens
    # (the stop token included; where an agent's stop string ended the turn, every token up to and including
    # the one that completed it, the rest of the engine's output dropped), ``output_logprobs`` their sampling
    # log-probabilities.
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    output_logprobs: list[float] | None = None
    # The weights that finished this call (the engine's weight_version).
    weight_version: str = ""
    # The engine's: why the call ended ("stop", "length", "abort"; "" where not recorded), and how many of its
    # input tokens the engine's prefix cache served.
    finish_reason: str = ""
    cached_tokens: NonNeg = 0
    # An external agent sent a history that is not the recorded one (it edited or dropped turns): this
    # call's ``prompt_ids`` are its whole context, rendered afresh, not a continuation of the steps before.
    rebased: bool = False
    # An external agent's call with ``n`` > 1: the index of the choice recorded in this step (the one the
    # agent continued from, 0 when it sent nothing after), and the call's other samples.
    choice: NonNeg = 0
    siblings: list[Sibling] | None = None


TrajStatus = Literal["completed", "failed", "aborted"]


class Trajectory(Struct):
    job_id: str
    traj_id: str
    task_id: str
    group: NonNeg
    sample: NonNeg
    env: str
    status: TrajStatus
    finish_reason: str
    steps: list[Step]
    started_at: float
    finished_at: float
    reward: float | None = None
    info: dict[str, Any] = {}
    # Rollout streams: the policy version that started the trajectory (its first call), which the
    # asynchronous bound is measured from.
    start_version: int | None = None

    @property
    def output_tokens(self) -> int:
        return sum(s.output_len for s in self.steps)


class TrajDone(Struct):
    """Event after a scored trajectory has been stored (core NATS, best effort)."""

    job_id: str
    traj_id: str
    status: TrajStatus
    reward: float | None
    output_tokens: NonNeg
    n_steps: NonNeg
    task_id: str = ""
    group: int = -1  # the job's group it sampled (-1: unknown): a predictor tells siblings from history by it
    # Why a trajectory that did not complete ended (``results.cause`` of its finish reason); "" when completed.
    cause: str = ""


# ---------------------------------------------------------------- generation


class GenRequest(Struct):
    """One LLM call of a trajectory. ``rid`` is stable across retries so that engines dedupe it."""

    rid: str
    job_id: str
    traj_id: str
    step: NonNeg
    input_len: Pos
    max_new_tokens: Pos
    input_ids: list[int] | None = None
    ignore_eos: bool = False
    priority: float = 0.0
    attempt: Pos = 1
    reply_to: str = ""
    temperature: NonNegF = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    return_logprob: bool = False
    # The trajectory's task tag: the router keeps it on the GPU types the job's hw_affinity maps it to.
    tag: str = ""
    # Stop strings and stop token ids (an external agent's ``stop``, vLLM's ``stop_token_ids``), for engines
    # that stop on them; the environment manager cuts the output at the first one in any case.
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Also return the top alternatives of each output token (0: none), as (token id, log-prob) pairs.
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] = 0
    # A scripted reply: the engine scores these tokens as its output instead of sampling (EngineRequest).
    forced_ids: list[int] | None = None
    # The call's own sampling seed (SamplingParams.seeded); none: the engine's.
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None


class GenAccepted(Struct, tag="accepted"):
    rid: str
    by: str


class GenKeepalive(Struct, tag="keepalive"):
    rid: str
    by: str
    state: Literal["queued", "running"]


class GenResult(Struct, tag="result"):
    rid: str
    worker_id: str
    output_len: NonNeg
    finish_reason: Literal["length", "stop", "abort"]
    output_ids: list[int] | None = None
    queue_s: NonNegF = 0.0
    prefill_s: NonNegF = 0.0
    decode_s: NonNegF = 0.0
    cached_tokens: NonNeg = 0
    weight_version: str = ""
    output_logprobs: list[float] | None = None
    # With ``top_logprobs``: per output token, its top alternatives as (token id, log-prob), best first.
    output_top_logprobs: list[list[tuple[int, float]]] | None = None


class GenError(Struct, tag="gen_error"):
    rid: str
    code: str
    message: str
    retryable: bool = True


GenEvent = GenAccepted | GenKeepalive | GenResult | GenError


class AbortRequest(Struct):
    """Abort one request (``rid``) or every request of a job or trajectory."""

    rid: str | None = None
    job_id: str | None = None
    traj_id: str | None = None


# ---------------------------------------------------------------- workers


class WorkerInfo(Struct):
    worker_id: str
    model: str
    engine: str
    gpu: str
    tp: Pos
    max_running: Pos
    kv_capacity_tokens: NonNeg
    started_at: float
    heartbeat_at: float
    # The longest context one request may have (vLLM's max_model_len, SGLang's context length); 0: unbounded.
    max_context_tokens: NonNeg = 0


class WorkerLoad(Struct):
    worker_id: str
    running: NonNeg
    waiting: NonNeg
    inflight: NonNeg
    kv_used_tokens: NonNeg
    kv_capacity_tokens: NonNeg
    generated_tokens: NonNeg
    at: float
    # Requests the worker holds now: lets a restarted router rebuild its view of the worker.
    rids: list[str] = []


class WorkerDone(Struct):
    worker_id: str
    rid: str
    output_len: NonNeg = 0
    engine_s: NonNegF = 0.0  # prefill + decode time of the call
    queue_s: NonNegF = 0.0  # time it waited in the engine


# ---------------------------------------------------------------- control


# KV loom_traj key of a job's Placement, beside its trajectories (no trajectory id starts with "_").
PLAN_KEY = "_plan"


class Placement(Struct):
    """A job's planned placement. For presorted plans, ``groups`` lists the worker of each partition
    from the longest trajectories down, with ``sizes`` their planned sizes (migration scales them)."""

    job_id: str
    assignments: dict[str, str]
    predicted: dict[str, float] = {}
    groups: list[str] = []
    sizes: list[int] = []


class PriorityUpdate(Struct):
    job_id: str
    traj_id: str
    priority: float
    predicted_remaining: float | None = None
    step: NonNeg = 0
    # The trajectory's context so far: what a migration target must warm before its next step.
    context_len: NonNeg = 0
    generated_tokens: NonNeg = 0
    method: str = ""  # the predictor that produced it (Prediction.method)


class WarmPrefix(Struct):
    """Ask a worker to load a trajectory's prefix (migration target, during the tool call)."""

    job_id: str
    traj_id: str
    input_len: Pos
    source: str = ""


class WarmDone(Struct):
    worker_id: str
    prefix_key: str
    input_len: NonNeg


class CancelJob(Struct):
    job_id: str


class GroupDone(Struct):
    """A group has its ``kept`` samples: its redundant samples still running are to be aborted."""

    job_id: str
    group: NonNeg
    kept: list[str] = []


# ---------------------------------------------------------------- prediction


class PredictRequest(Struct):
    job_id: str
    traj_id: str
    task_id: str
    step: NonNeg
    context_len: NonNeg
    generated_tokens: NonNeg
    # What the learned predictor reads: the task statement and what followed it (actions and observations,
    # oldest first), clipped by the sender with loom.predict.context so that a request stays small.
    prompt: str = ""
    pieces: list[str] = []
    # The job's group the trajectory samples (-1: unknown, as for a whole task's estimate at planning):
    # finished samples of the same group are its siblings, those of other groups the prompt's history.
    group: int = -1
    prompt_tokens: NonNeg = 0  # tokens of its prompt, its first call's input (0: unknown)
    # The trace set its task comes from, where the task says (``TaskSpec.data["workload"]``).
    workload: str = ""


class Prediction(Struct):
    traj_id: str
    remaining_tokens: NonNegF
    total_tokens: NonNegF
    method: str
    # How far the method's totals stray from the truth (log standard deviation; 0: not measured) and how much
    # of a difference between two of its totals at admission is real (the slope of true on predicted log
    # totals; 1: all of it): placement shrinks differences by the slope and treats the rest closer than the
    # error as ties.
    log_sd: NonNegF = 0.0
    slope: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0


# ---------------------------------------------------------------- reward


class RewardRequest(Struct):
    """A finished trajectory to score; ``kind`` names the reward function (built-in or ``module:fn``)."""

    trajectory: Trajectory
    kind: str = "replay"
    tenant: str = "default"
    # The task the trajectory ran (its data set and id lead to the ground truth) and the job's parameters.
    task: TaskSpec | None = None
    params: dict[str, Any] = {}


class RewardAssign(Struct):
    """Controller -> reward worker: one delivery of a reward request (the stream message's bytes)."""

    data: bytes
    deadline_s: NonNegF


class RewardOutcome(Struct):
    """Reward worker -> controller. ``ok``: stored (or already stored); otherwise why, and whether to retry."""

    ok: bool
    # The worker's busy seconds so far (at least one request in hand), for the pool's utilisation.
    busy_s: NonNegF = 0.0
    duplicate: bool = False
    error: str = ""
    retryable: bool = True


class WorkerReady(Struct):
    worker_id: str


# ---------------------------------------------------------------- rollout streams (training with Loom)


class StreamSpec(JobSpec, forbid_unknown_fields=True):
    """A rollout stream (``POST /v1/streams``): a job's spec whose groups keep flowing to a trainer.

    Groups are started from the data set, in a new order each epoch when ``shuffle`` is set, while fewer than
    ``buffer_groups`` are running or waiting for the trainer (back-pressure). A trajectory started by policy
    version s is aborted, with its group restarted, once the policy reaches a version above s + async_bound
    (RollArt's asynchronous bound; 0 is synchronous training)."""

    async_bound: Annotated[int, Meta(ge=0, le=1000)] = 1
    buffer_groups: Annotated[int, Meta(ge=1, le=100_000)] = 16
    # Passes over the data set; None: until the stream is cancelled.
    epochs: Annotated[int, Meta(ge=1, le=1_000_000)] | None = 1
    shuffle: bool = True
    shuffle_seed: NonNeg = 0
    # The trainer renews its lease (the SDK does so by itself); a stream without one this long is released.
    lease_s: Annotated[float, Meta(gt=0, le=86_400)] = 120.0

    def job_spec(self) -> JobSpec:
        fields = {f: getattr(self, f) for f in JobSpec.__struct_fields__}
        return JobSpec(**fields)


StreamState = Literal["running", "completed", "cancelled", "failed"]


class OpenGroup(Struct):
    """A group started and not yet handed to the trainer: the data set position it samples, and its members'
    result-stream sequence numbers as they finish (``done``: trajectory id -> sequence)."""

    pos: NonNeg
    task_id: str
    done: dict[str, int] = {}
    start_version: int | None = None
    # Published to the sample buffer (complete), waiting for the trainer.
    buffered: bool = False


class Stream(Struct):
    """A rollout stream's durable record (KV ``loom_streams``), rewritten on every change."""

    id: str
    spec: StreamSpec
    state: StreamState
    created_at: float
    lease_until: float
    version: NonNeg = 0
    # The policy version at which the trainer last took a batch (-1: never).
    consumed_version: int = -1
    # Data set positions started so far (position p is epoch p // n, the p % n-th task of that epoch's order).
    next_pos: NonNeg = 0
    next_group: NonNeg = 0
    # Positions whose group was aborted by the bound, to be sampled again first.
    retry: list[int] = []
    open: dict[int, OpenGroup] = {}
    delivered: NonNeg = 0
    stale_groups: NonNeg = 0
    n_tasks: NonNeg = 0
    finished_at: float | None = None
    error: str | None = None


class SampleGroup(Struct):
    """A finished group in a stream's sample buffer (``loom.v1.samples.<stream>``): its trajectories are read
    from the result stream by sequence, so a group of long trajectories stays a small message."""

    stream_id: str
    group: NonNeg
    task_id: str
    start_version: int
    traj_ids: list[str]
    seqs: list[int]


class StreamRef(Struct):
    stream_id: Ident


class BatchTaken(Struct):
    """The trainer took ``groups`` at policy ``version``; ``stale`` ones broke the bound and are sampled again."""

    stream_id: Ident
    version: NonNeg
    groups: list[int] = []
    stale: list[int] = []


WeightTransport = Literal["disk", "collective", "store"]
# Tensor dtypes the transports carry (torch's names): the weights move in their own dtype, never converted.
WeightDtype = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"]


class TensorSpec(Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor of a weights version: its name in the model's state dict, dtype and shape."""

    name: Annotated[str, Meta(min_length=1, max_length=512)]
    dtype: WeightDtype
    shape: list[NonNeg]


class WeightsRef(Struct, forbid_unknown_fields=True):
    """Where a weights version is and how a worker gets it (``loom.weights``).

    - ``disk``: a Hugging Face checkpoint directory every worker can read (``path``).
    - ``collective``: the trainer broadcasts the tensors over torch.distributed (``backend``, gloo on CPUs,
      NCCL on GPUs) from rank 0 to the workers, in buckets of ``bucket_bytes``; ``address`` is its rendezvous
      store (``host:port``), ``group`` this update's group. The scheduler sets each worker's ``rank`` and the
      group's ``world_size`` (the trainer and every worker).
    - ``store``: the trainer published the tensors to the JetStream object store ``address`` as the objects
      under ``group``, one per bucket; each worker fetches them on its own.

    ``tensors`` and ``checksum`` (``loom.weights.manifest``) let a receiver check what arrived."""

    transport: WeightTransport = "disk"
    path: str | None = None
    address: Annotated[str, Meta(max_length=256)] = ""
    group: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{0,128}$")] = ""
    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: NonNeg = 0
    tensors: list[TensorSpec] = []
    checksum: Annotated[str, Meta(max_length=64)] = ""
    rank: NonNeg = 0
    world_size: NonNeg = 0


class WeightUpdate(Struct):
    """Move every rollout worker of the stream's model to ``version``, loaded from ``weights`` (``path``: a
    checkpoint directory each worker can read, as ``WeightsRef(transport="disk", path=...)``; neither: a
    simulated engine's version switch).

    ``async_fetch`` (RollArt §5.2): the workers fetch and load the new weights beside the serving ones while
    they go on generating, and the fleet pauses only to switch; otherwise it pauses for the whole load, as
    a broadcast update does."""

    stream_id: Ident
    version: NonNeg
    path: str | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 300.0
    async_fetch: bool = True
    weights: WeightsRef | None = None

    def ref(self) -> WeightsRef:
        return self.weights if self.weights is not None else WeightsRef("disk", self.path)


class WeightUpdateResult(Struct):
    version: int
    workers: list[str]
    pause_s: NonNegF  # generation held
    total_s: NonNegF
    aborted: NonNeg = 0
    fetch_s: NonNegF = 0.0  # loading while generating (``async_fetch``)


class StreamVersion(Struct):
    """Broadcast after a fleet update: environment managers abort trajectories the bound no longer admits."""

    stream_id: str
    version: NonNeg
    async_bound: NonNeg


class GroupRestart(Struct):
    """A group broke the bound: its members still running stop; the stream samples its task again."""

    job_id: str
    group: NonNeg
    reason: str = ""


WeightOpKind = Literal["pause", "prepare", "commit", "discard", "resume"]


class WeightOp(Struct):
    """Scheduler -> rollout worker (request/reply on ``loom.v1.worker.<id>.weights``): one step of a fleet update."""

    op: WeightOpKind
    version: str = ""
    path: str | None = None  # prepare, of a ``disk`` update without ``weights`` (a scheduler before them)
    # pause: resume by itself after this long without a commit or resume (a scheduler that died mid-update
    # must not leave the fleet paused for ever); whatever was prepared is then discarded.
    lease_s: NonNegF = 0.0
    # prepare: how long the worker may take to receive the weights (the scheduler waits as long).
    timeout_s: NonNegF = 0.0
    weights: WeightsRef | None = None  # prepare


class WeightOpReply(Struct):
    worker_id: str
    ok: bool
    version: str
    error: str = ""


class FleetWeights(Struct):
    """The weights a model's fleet serves (KV ``loom_weights``, key = model): a worker that starts or restarts
    loads them before it takes requests, so the fleet is never mixed."""

    model: str
    version: str
    path: str | None = None
    updated_at: float = 0.0
    # How it came (None: from ``path``, on disk). A worker that (re)starts takes a ``disk`` or ``store``
    # version itself; a ``collective`` one has gone by, so it holds its requests until the next update.
    weights: WeightsRef | None = None


# ---------------------------------------------------------------- co-scheduled RL jobs (RollMux)

PhaseName = Literal["rollout", "train"]
ModelSize = Literal["3b", "7b", "14b", "32b"]


class RLJobSpec(Struct, forbid_unknown_fields=True):
    """An RL training job to co-schedule (``POST /v1/rljobs``): its worst-case phase profile, footprint and
    SLO. Phase times assume every response reaches the maximum length (the plan must hold at worst)."""

    name: Ident
    model: ModelSize
    # A phase of at most a year, pools of at most 256 nodes (2,048 GPUs) each: what a plan can hold.
    rollout_s: Annotated[float, Meta(gt=0, le=3.2e7)]
    train_s: Annotated[float, Meta(gt=0, le=3.2e7)]
    slo: Annotated[float, Meta(ge=1.0, le=1000.0)] = 1.5
    rollout_nodes: Annotated[int, Meta(ge=1, le=256)] = 1
    train_nodes: Annotated[int, Meta(ge=1, le=256)] = 1


class RLJobRecord(Struct):
    """What the scheduler stores per RL job: replayed in ``created_at`` order after a restart."""

    spec: RLJobSpec
    created_at: float


class RLJobPlacement(Struct):
    job: str
    group: int
    rollout_nodes: list[int]
    train_nodes: int
    strategy: str  # direct | scaling | isolated
    period_s: float  # the group's planned meta-iteration, the job's worst-case iteration
    delta_cost: float  # $/h the admission added
    created_at: float


class PhaseRequest(Struct):
    job: Ident
    phase: PhaseName


class PhaseDone(Struct):
    job: Ident
    phase: PhaseName


class PhaseProgress(Struct):
    job: Ident
    done_fraction: Annotated[float, Meta(ge=0.0, le=1.0)]


class PhaseAck(Struct, tag="ack"):
    granted: bool  # True: the permit is already published; False: queued for its turn


class PhasePermit(Struct):
    job: str
    phase: PhaseName
    group: int
    nodes: list[int]  # rollout nodes, or [-1] for the training pool
    gpus: dict[int, int]


class TailMigration(Struct):
    """Consolidate the rollout's remaining responses onto ``gpus`` GPUs of ``node``; the rest are taken."""

    job: str
    node: int
    gpus: int
    at: float  # the scheduler's wall clock when it decided: the next rollout's permit follows it


# ---------------------------------------------------------------- service plumbing


class Health(Struct):
    service: str
    instance: str
    ok: bool
    uptime_s: NonNegF
    version: str
    pid: int
    details: dict[str, Any] = {}
    # Taking requests: it has done what it does first (a rollout worker's engine up, its join of the fleet's
    # weights done or, after a broadcast it missed, its requests held for the next update, and its handlers
    # subscribed). ``ok`` alone says the process answers. Absent (an older service): taken as serving.
    ready: bool = True


class ErrorReply(Struct, tag="error"):
    code: str
    message: str


class DeadLetter(Struct):
    service: str
    subject: str
    reason: str
    payload: bytes

"""Turning a job spec into concrete tasks and trajectories."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from loom.data.traces import Trace, TraceError, load_traces
from loom.envs import registry, tasksets
from loom.envs.adapters import BadParams, LibraryMissing, UnknownName
from loom.envs.replay import SIBLINGS
from loom.identity import allowlist
from loom.protocol import DatasetRef, JobSpec, TaskSpec, TrajWork, subjects
from loom.protocol.messages import BUILTIN_REWARDS
from loom.runtime.workers import WorkerInfo, context_limit


class SpecError(ValueError):
    """An invalid job spec; ``loc`` is the path of the offending field."""

    def __init__(self, loc: list[str | int], msg: str) -> None:
        super().__init__(msg)
        self.loc = loc
        self.msg = msg


def check_context(spec: JobSpec, workers: Iterable[WorkerInfo]) -> None:
    """SpecError when the job's token budget or one call's is past the context every live worker serving its
    model takes (vLLM's max_model_len, SGLang's context length): a trajectory's context holds all it generated,
    so such a budget can never be spent (an agent's, which may start afresh, is bounded per call only). Nothing
    is checked while no worker says."""
    limit = context_limit(workers, spec.model)
    if limit is None:
        return
    budgets = [("max_tokens", spec.max_tokens), ("max_turn_tokens", spec.max_turn_tokens)]
    if registry.resolve(spec.env).loop in ("external", "verifiers"):
        budgets = budgets[1:]  # an agent's calls need not share one context: it may start afresh
    for field, value in budgets:
        if value is not None and value > limit:
            raise SpecError(
                [field],
                f"{field} is {value}, past the {limit}-token context of the workers serving {spec.model} (prompt "
                f"included): give at most {limit}",
            )


def work_subject(job_id: str, env: str) -> str:
    """Where a job's (or a stream's) trajectory work goes: its environment's lane (a library with a virtualenv of
    its own runs only in managers started from it)."""
    return subjects.traj_work(job_id, registry.resolve(env).lane)


def resolve_tasks(spec: JobSpec, default_traces: str | None) -> list[TaskSpec]:
    if spec.reward is not None and ":" not in spec.reward and spec.reward not in BUILTIN_REWARDS:
        raise SpecError(
            ["reward"], f"unknown reward {spec.reward!r}: one of {BUILTIN_REWARDS} or module:function"
        )
    if spec.reward is not None and ":" in spec.reward:
        _allowed(["reward"], allowlist.check_code, spec.reward)
    if spec.tasks and spec.dataset is not None:
        raise SpecError(["dataset"], "give either tasks or dataset, not both")
    if not spec.tasks and spec.dataset is None:
        raise SpecError(["tasks"], "a job needs tasks or a dataset")
    # Files a client names are read only inside the operator's data directories (loom.identity.allowlist).
    if spec.dataset is not None and spec.dataset.path:
        _allowed(["dataset", "path"], allowlist.check_data_file, spec.dataset.path)
    for n, t in enumerate(spec.tasks):
        for key in ("path", "traces_path"):
            value = t.data.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise SpecError(["tasks", n, "data", key], "a path must be a string")
                _allowed(["tasks", n, "data", key], allowlist.check_data_file, value)
    try:
        kind = registry.resolve(spec.env).kind
    except ValueError as e:
        raise SpecError(["env"], str(e)) from e
    if isinstance(kind, registry.Library):
        return _library_tasks(spec)
    if kind.loop in ("user", "external"):
        return _record_tasks(spec)
    if spec.dataset is not None and spec.dataset.name == "jsonl":
        raise SpecError(["dataset", "name"], f"a jsonl task set feeds user environments, not {spec.env!r}")
    if kind.loop != "replay":
        return _env_tasks(spec)
    path = spec.dataset.path if spec.dataset is not None and spec.dataset.path else default_traces
    try:
        traces = load_traces(path)
    except TraceError as e:
        raise SpecError(["dataset", "path"], str(e)) from e
    if spec.dataset is not None:
        ids = _window(spec.dataset, list(traces), "traces")
        siblings = spec.dataset.siblings
        return [TaskSpec(id=i, data={**_replay_data(traces[i], path), "siblings": siblings}) for i in ids]
    out = []
    for n, t in enumerate(spec.tasks):
        tid = t.data.get("trace_id", t.id)
        if not isinstance(tid, str) or tid not in traces:
            raise SpecError(["tasks", n, "data", "trace_id"], f"unknown trace id {tid!r}")
        if t.data.get("siblings", "varied") not in SIBLINGS:
            raise SpecError(["tasks", n, "data", "siblings"], f"siblings must be one of {SIBLINGS}")
        out.append(TaskSpec(id=t.id, data={**t.data, **_replay_data(traces[tid], path)}))
    return out


def _record_tasks(spec: JobSpec) -> list[TaskSpec]:
    """Tasks of a user environment or an external agent: inline, one per line of a jsonl set, or a built-in
    task set's (each with its statement as ``prompt`` and the set it came from, so that the set's reward finds
    its ground truth), each task's data handed to the environment (or the agent) as it is. The environment's
    code is never imported here: its path is checked against the operator's allowlist as text."""
    if spec.env != "external":
        _allowed(["env"], allowlist.check_code, spec.env)
    if spec.scripted:
        raise SpecError(
            ["scripted"], "scripted actions come from the built-in environments' reference solutions"
        )
    ds = spec.dataset
    if ds is None:
        return list(spec.tasks)
    if ds.name is None:
        raise SpecError(["dataset", "name"], "name a task set, or jsonl with its path")
    if ds.name != "jsonl":
        try:
            env = registry.env_of_set(ds.name)
            ids = _window(ds, registry.task_ids(env, ds.name, ds.path), f"tasks of {ds.name}")
            return registry.task_specs(env, ds.name, ds.path, ids)
        except SpecError:
            raise
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise SpecError(["dataset", "name"], str(e).strip("'\"")) from e
    if not ds.path:
        raise SpecError(["dataset", "path"], "a jsonl task set needs its path")
    try:
        recs = tasksets.records(ds.path)
    except (ValueError, OSError) as e:
        raise SpecError(["dataset", "path"], str(e)) from e
    return [TaskSpec(id=i, data=recs[i]) for i in _window(ds, list(recs), "tasks")]


def _allowed(loc: list[str | int], check: Callable[[str], object], value: str) -> None:
    try:
        check(value)
    except allowlist.NotAllowed as e:
        raise SpecError(loc, str(e)) from e


def _library_tasks(spec: JobSpec) -> list[TaskSpec]:
    """Tasks of a library's environment, generated under the job's ``env_params``: a window of them
    (``dataset`` naming no set or file), or listed by id. The library is imported here (not the user's code):
    a job it cannot serve is refused now, not failed later."""
    ds = spec.dataset
    if ds is not None and (ds.name is not None or ds.path):
        field = "name" if ds.name is not None else "path"
        raise SpecError(["dataset", field], f"{spec.env} generates its tasks: name no task set or file")
    loc: list[str | int] = ["dataset"] if ds is not None else ["tasks", 0, "id"]
    try:
        if ds is not None:
            ids = _window(
                ds, registry.task_ids(spec.env, None, None, spec.env_params), f"tasks of {spec.env}"
            )
        else:
            ids = [t.id for t in spec.tasks]
        specs = registry.task_specs(spec.env, None, None, ids, spec.env_params)
    except SpecError:
        raise
    except (LibraryMissing, UnknownName, allowlist.NotAllowed) as e:
        raise SpecError(["env"], str(e)) from e
    except BadParams as e:
        raise SpecError(["env_params"], str(e)) from e
    except (ValueError, KeyError) as e:
        raise SpecError(loc, str(e).strip("'\"")) from e
    if spec.scripted:
        try:
            for t in specs:
                registry.reference_actions(spec.env, t)
        except ValueError as e:
            raise SpecError(["scripted"], f"{spec.env}: {e}") from e
    return specs


def _env_tasks(spec: JobSpec) -> list[TaskSpec]:
    """Tasks of the code, math and search environments, from a task set (by name or per task)."""
    ds = spec.dataset
    name: str
    if ds is not None:
        # A dataset that names no set is the environment's default set.
        name, path = ds.name or registry.DATASETS[spec.env][0], ds.path
        loc: list[str | int] = ["dataset", "name"]
    else:
        first = spec.tasks[0].data.get("set", registry.DATASETS[spec.env][0])
        name, path = str(first), spec.tasks[0].data.get("path")
        loc = ["tasks", 0, "data", "set"]
    try:
        if ds is not None:
            ids = _window(ds, registry.task_ids(spec.env, name, path), f"tasks of {name}")
        else:
            ids = [t.id for t in spec.tasks]
        specs = registry.task_specs(spec.env, name, path, ids)
        if spec.scripted:
            for t in specs:
                registry.reference_actions(spec.env, t)
    except SpecError:
        raise
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise SpecError(loc, str(e).strip("'\"")) from e
    return specs


def _window(ds: DatasetRef, ids: list[str], what: str) -> list[str]:
    """The dataset's ``offset``/``limit`` window over the ids; past the end is the offset's error."""
    chosen = ids[ds.offset :][: ds.limit] if ds.limit is not None else ids[ds.offset :]
    if not chosen:
        raise SpecError(["dataset", "offset"], f"offset {ds.offset} is past the {len(ids)} {what}")
    return chosen


def _replay_data(trace: Trace, path: str | None) -> dict[str, object]:
    # The first prompt's length is what a prompt-only prediction sees; the default traces are the coding
    # trace set, the workload the predictor's combiner knows them as.
    data: dict[str, object] = {
        "trace_id": trace.id,
        "traces_path": path,
        "prompt_tokens": trace.steps[0].prompt_tokens,
    }
    if path is None:
        data["workload"] = "coding"
    return data


def traj_id(group: int, sample: int) -> str:
    return f"t{group:05d}-s{sample:03d}"


def expand(job_id: str, spec: JobSpec) -> list[TrajWork]:
    return [w for g, task in enumerate(spec.tasks) for w in group_works(job_id, spec, task, g)]


def group_works(
    job_id: str, spec: JobSpec, task: TaskSpec, g: int, async_bound: int | None = None
) -> list[TrajWork]:
    """The samples of group ``g`` (a rollout stream passes its asynchronous bound along)."""
    return [
        TrajWork(
            job_id=job_id,
            traj_id=traj_id(g, s),
            task=task,
            group=g,
            sample=s,
            env=spec.env,
            model=spec.model,
            max_turns=spec.max_turns,
            max_tokens=spec.max_tokens,
            max_turn_tokens=spec.max_turn_tokens,
            tool_latency=spec.tool_latency,
            seed=spec.seed * 1_000_003 + g * 1009 + s,
            scripted=spec.scripted,
            group_size=spec.group_size,
            redundancy=spec.redundancy,
            env_concurrency=spec.env_concurrency,
            tool_timeout_s=spec.tool_timeout_s,
            tenant=spec.tenant,
            reward=reward_of(spec),
            reward_params=spec.reward_params,
            sampling=spec.sampling,
            async_bound=async_bound,
            tag=tag_of(spec, task),
            env_params=spec.env_params,
            session_idle_s=spec.session_idle_s,
        )
        for s in range(samples_per_group(spec))
    ]


def tag_of(spec: JobSpec, task: TaskSpec) -> str:
    """A task's tag for hardware affinity: its data's ``tag``, else the job's environment."""
    tag = task.data.get("tag")
    return tag if isinstance(tag, str) and tag else spec.env


def reward_of(spec: JobSpec) -> str:
    """The job's reward function: its own choice, else the recorded outcome (replay) or the env's verdict."""
    if spec.reward is not None:
        return spec.reward
    return "replay" if spec.env == "replay" else "env"


def samples_per_group(spec: JobSpec) -> int:
    return spec.group_size + spec.redundancy

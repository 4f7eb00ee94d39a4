"""Workloads from rollout-trace files (``loom.data.rollout_trace``): any team's rollouts, replayed as they were
recorded: their own groups (no synthetic siblings), lengths and environment times, one training step at a
time; and the built-in workloads written out in that schema, so that they load through the same path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loom.data import rollout_trace as rt
from loom.data.traces import Trace, TraceStep
from loom.protocol import Trajectory as Result
from loom.workloads.base import Workload, WorkStep, WorkTraj, mean_env_s


@dataclass(frozen=True)
class Recorded:
    """A rollout-trace file as the harness replays it: each training step's batch, steps in order."""

    name: str
    steps: dict[int, Workload]
    turns: int
    turns_without_env_s: int  # turns whose environment time the file does not give (replayed as 0 s)
    # Where the file has text: each trajectory's as the text model reads a recorded run (by ``WorkTraj.trace``).
    traces: dict[str, Trace] = field(default_factory=dict)

    @property
    def has_text(self) -> bool:
        """Every trajectory carries its prompt's and its calls' text (a file is never empty)."""
        return bool(self.traces)

    def step(self, step: int | None = None) -> tuple[int, Workload]:
        """The batch of training step ``step`` (None: the first the file holds)."""
        if step is None:
            step = min(self.steps)
        if step not in self.steps:
            raise ValueError(f"{self.name}: no step {step}; the file holds steps {sorted(self.steps)}")
        return step, self.steps[step]

    def batch(self, step: int | None = None, prompts: int | None = None) -> Workload:
        """Step ``step``'s batch (``step``), its first ``prompts`` groups only where that is given."""
        _, w = self.step(step)
        if prompts is None:
            return w
        keep = set(list(w.by_prompt())[:prompts])
        return Workload(w.name, w.source, [t for t in w.trajectories if t.prompt in keep])

    def mean_env_s(self) -> float:
        """``loom.workloads.base.mean_env_s`` over every step of the file; a turn it gives no time for counts
        as the 0 s it replays at (``turns_without_env_s``)."""
        return mean_env_s(t for w in self.steps.values() for t in w.trajectories)


def load(path: str | Path, name: str | None = None) -> Recorded:
    """A rollout-trace file as one workload per training step (``rollout_trace.read`` validates it); where
    every trajectory has its text, each names its ``Trace`` (``Recorded.traces``), as a built-in one names
    its recorded run, for the learned predictor to read."""
    p = Path(path)
    trajectories = rt.read(p)
    label = name or p.name.split(".")[0]
    text = all(t.has_text for t in trajectories)
    steps: dict[int, Workload] = {}
    traces: dict[str, Trace] = {}
    missing = 0
    for step, ts in rt.by_step(trajectories):
        w = Workload(label, f"rollout trace {p}, step {step}")
        for t in ts:
            calls = []
            for turn in t.turns:
                env_s = turn.env_seconds
                missing += env_s is None
                calls.append(WorkStep(turn.context_tokens, turn.output_tokens, env_s or 0.0))
            trace = _trace(t) if text else None
            if trace is not None:
                traces[trace.id] = trace
            w.trajectories.append(
                WorkTraj(
                    t.key,
                    t.group,
                    t.sample,
                    tuple(calls),
                    t.reward,
                    task=t.task or "",
                    trace=trace.id if trace is not None else "",
                    system=t.system_tokens or 0,
                )
            )
        steps[step] = w
    return Recorded(label, steps, sum(len(t.turns) for t in trajectories), missing, traces)


def _trace(t: rt.Trajectory) -> Trace:
    """A trajectory's text as a recorded run: its id the group's up to ``#`` (``traces.prompt_id``), so the
    learned predictor's folds deal it by its prompt, as they deal a built-in workload's."""
    steps = tuple(
        TraceStep(turn.context_tokens, turn.output_tokens, turn.action or "", turn.observation or "", 0)
        for turn in t.turns
    )
    return Trace(f"{t.group}#{t.key}", bool(t.reward), "", steps, task=t.prompt or "")


def to_trace(w: Workload, step: int = 0, traces: Mapping[str, Trace] | None = None) -> list[rt.Trajectory]:
    """``w``'s trajectories in the schema, as training step ``step``; with the recorded ``traces`` they
    replay (by id), their text: the task statement and each call's action and observation."""
    out = []
    for t in w.trajectories:
        trace = (traces or {}).get(t.trace) if t.trace else None
        turns = []
        for k, s in enumerate(t.steps):
            # The recorded call this step replays (a coding sibling drops or repeats some).
            src = trace.steps[t.origin[k] if t.origin else k] if trace is not None else None
            action, observation = (src.action, src.observation) if src else (None, None)
            turns.append(
                rt.Turn(s.input_len, s.output_len, env_s=s.env_s, action=action, observation=observation)
            )
        out.append(
            rt.Trajectory(
                rt.SCHEMA,
                t.prompt,
                t.sample,
                turns,
                step=step,
                id=t.id,
                reward=t.reward,
                prompt=trace.task if trace is not None else None,
                task=t.task or w.name,
                system_tokens=t.system or None,
            )
        )
    return out


def from_results(results: Iterable[Result]) -> tuple[list[rt.Trajectory], int]:
    """A Loom job's stored trajectories in the schema, and how many were left out (none of their calls ran).
    A group is its task (the same task in two of a job's groups: each its own, ``#g`` and its index); the
    step the policy version that started it (0 for a one-shot job)."""
    results = list(results)
    groups_of: dict[str, set[int]] = {}
    for r in results:
        groups_of.setdefault(r.task_id, set()).add(r.group)
    out, skipped = [], 0
    for r in results:
        if not r.steps:
            skipped += 1
            continue
        group = r.task_id if len(groups_of[r.task_id]) == 1 else f"{r.task_id}#g{r.group}"
        turns = [
            rt.Turn(
                s.prompt_len,
                s.output_len,
                cached_tokens=min(s.cached_tokens, s.prompt_len),
                finish_reason=s.finish_reason or None,
                env_s=s.tool_s,
                action=s.action,
                observation=s.observation,
            )
            for s in r.steps
        ]
        out.append(
            rt.Trajectory(
                rt.SCHEMA,
                group,
                r.sample,
                turns,
                step=r.start_version or 0,
                id=r.traj_id,
                reward=r.reward,
                task=r.env,
            )
        )
    return out, skipped

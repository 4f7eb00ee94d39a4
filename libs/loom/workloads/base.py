"""A workload: GRPO-style groups of multi-turn trajectories, each a list of LLM calls and the environment
time that follows them."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from loom.data.traces import Trace, TraceStep, prompt_of

# Heddle §7: every rollout caps a trajectory's output at 40K tokens.
MAX_OUTPUT = 40_960
# RollArt §7.1: a maximum context length of 32K tokens.
ROLLART_CONTEXT = 32_768


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A log-normal draw with the given mean (mu = ln(mean) - sigma^2 / 2); 0 for no time, the mean itself
    for no spread."""
    if mean <= 0:
        return 0.0
    if sigma == 0:
        return mean
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)


@dataclass(frozen=True)
class WorkStep:
    input_len: int  # context tokens of the call
    output_len: int  # tokens it generates
    env_s: float  # environment time after it (tool, or user simulator); 0 after the last call
    # The expectation ``env_s`` is a random draw from (a tool's latency), where it is one; None: ``env_s``
    # follows from the step itself (a simulated user's reply to its text, a recorded time). Not part of a
    # step's identity: what ran is the same whatever its generator knew (a trace file records no mean).
    env_mean_s: float | None = field(default=None, compare=False)

    @property
    def expected_env_s(self) -> float:
        """The environment time knowable before it runs: what knowing the trajectory exactly (its calls,
        their lengths, what each tool returns) tells of it, without the tool's latency draw."""
        return self.env_s if self.env_mean_s is None else self.env_mean_s

    def without_env(self) -> WorkStep:
        """The step as a trajectory's last: nothing follows it but scoring."""
        return WorkStep(self.input_len, self.output_len, 0.0)


@dataclass(frozen=True)
class WorkTraj:
    id: str
    prompt: str  # the group: samples of one prompt share it
    sample: int
    steps: tuple[WorkStep, ...]
    reward: float | None = None
    task: str = ""  # the workload it came from, for multi-task batches and hardware affinity
    trace: str = ""  # the recorded trajectory it replays (``loom.data.trace_sets``)
    # The recorded step each step replays (a sibling drops or repeats some); empty: step k replays step k.
    origin: tuple[int, ...] = ()
    # Tokens its first input starts with that are the same for every trajectory of its task set (the system
    # prompt, tools and chat template): engines keep one copy in their prefix cache for all of them.
    system: int = 0

    @functools.cached_property
    def output_tokens(self) -> int:
        return sum(s.output_len for s in self.steps)

    @functools.cached_property
    def calls(self) -> tuple[tuple[int, int], ...]:
        """Each LLM call's ``(input_len, output_len)``: what an engine sees of the trajectory."""
        return tuple((s.input_len, s.output_len) for s in self.steps)

    @functools.cached_property
    def tool_s(self) -> float:
        """Seconds in the environment between its calls: the step after the last call only scores it."""
        return sum(s.env_s for s in self.steps[:-1])

    @functools.cached_property
    def expected_tool_s(self) -> float:
        """``tool_s`` with each tool latency at its mean: all of it an exact predictor could know."""
        return sum(s.expected_env_s for s in self.steps[:-1])

    @property
    def final_context(self) -> int:
        """Tokens of the whole trajectory as one sequence (what a trainer trains on)."""
        return self.steps[-1].input_len + self.steps[-1].output_len if self.steps else 0


@dataclass
class Workload:
    name: str
    source: str  # how it was built, for the report
    trajectories: list[WorkTraj] = field(default_factory=list)

    @property
    def groups(self) -> int:
        return len({t.prompt for t in self.trajectories})

    def mean_env_s(self) -> float:
        return mean_env_s(self.trajectories)

    @property
    def max_context(self) -> int:
        """Its longest call, input and output: what every engine that may serve it must hold (the least
        ``max_model_len`` a deployment could give it)."""
        return max((i + o for t in self.trajectories for i, o in t.calls), default=0)

    def by_prompt(self) -> dict[str, list[WorkTraj]]:
        """Each prompt's samples (its group), prompts and samples in the workload's order."""
        out: dict[str, list[WorkTraj]] = {}
        for t in self.trajectories:
            out.setdefault(t.prompt, []).append(t)
        return out

    def _system_key(self, t: WorkTraj) -> str:
        return f"system:{t.task or self.name}"

    def shared_prefixes(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Each trajectory's ``EngineRequest.shared_prefix``: its task set's system prompt, then its group's
        prompt where every sample starts from the same first input (same length: a replayed trace set's trials
        of one prompt can open differently, tau-bench's simulated user does, and then share the system prompt
        alone)."""
        out: dict[str, tuple[tuple[str, int], ...]] = {}
        # A set's system prompt, as its traces count it (the least of them, should they differ).
        system: dict[str, int] = {}
        for t in self.trajectories:
            if t.steps:
                key = self._system_key(t)
                system[key] = min(system.get(key, t.system), t.system, t.steps[0].input_len)
        for prompt, group in self.by_prompt().items():
            firsts = {t.steps[0].input_len for t in group if t.steps}
            common = next(iter(firsts)) if len(firsts) == 1 else 0
            for t in group:
                shared = system.get(self._system_key(t), 0)
                levels = [(self._system_key(t), shared)] if shared else []
                if common > shared:
                    levels.append((f"prompt:{prompt}", common))
                out[t.id] = tuple(levels)
        return out


def group_traces(traces: Iterable[Trace]) -> dict[str, list[Trace]]:
    """The recorded trials of each prompt, prompts and trials in file order."""
    out: dict[str, list[Trace]] = {}
    for t in traces:
        out.setdefault(prompt_of(t), []).append(t)
    return out


def replay(
    id: str,
    prompt: str,
    sample: int,
    trace: Trace,
    env_s: Callable[[TraceStep], float],
    env_mean_s: Callable[[TraceStep], float | None] = lambda _: None,
    system: int = 0,
) -> WorkTraj:
    """A sample that replays a recorded trajectory call for call, with its own environment times: ``env_s``
    draws each, ``env_mean_s`` gives the mean of a random draw (None: the time follows from the step);
    ``system``: ``WorkTraj.system``."""
    steps = [
        WorkStep(st.prompt_tokens, st.completion_tokens, env_s(st), env_mean_s(st)) for st in trace.steps
    ]
    reward = 1.0 if trace.resolved else 0.0
    return WorkTraj(id, prompt, sample, cap_output(steps), reward, trace=trace.id, system=system)


def cap_output(steps: list[WorkStep], max_output: int = MAX_OUTPUT) -> tuple[WorkStep, ...]:
    """Cut a trajectory where its output reaches ``max_output`` tokens (the last call is truncated)."""
    out, budget = [], max_output
    for s in steps:
        n = min(s.output_len, budget)
        budget -= n
        out.append(s if n == s.output_len else replace(s, output_len=max(1, n)))
        if budget <= 0:
            break
    if out:
        out[-1] = out[-1].without_env()
    return tuple(out)


def cap_context(steps: tuple[WorkStep, ...], max_context: int = ROLLART_CONTEXT) -> tuple[WorkStep, ...]:
    """Cut a trajectory where its context reaches ``max_context`` tokens: the call that crosses it generates
    up to the limit and is the last (a call whose input alone is over it never runs)."""
    out: list[WorkStep] = []
    for s in steps:
        room = max_context - s.input_len
        if room <= 0:
            break
        if s.output_len >= room:
            out.append(replace(s, output_len=room))
            break
        out.append(s)
    if out:
        out[-1] = out[-1].without_env()
    return tuple(out)


def mean_env_s(trajectories: Iterable[WorkTraj]) -> float:
    """Mean environment seconds per call between calls (the step after the last call only scores it), each
    at its mean where it is a draw (``WorkStep.expected_env_s``): the tool time per call a cluster plans with
    (``Cluster.tool_s``), for a built-in workload and a rollout-trace file alike."""
    trajs = list(trajectories)
    gaps = sum(len(t.steps) - 1 for t in trajs if t.steps)
    # To the nanosecond: a workload whose every call has one mean plans with that mean, not one a rounding off.
    return round(math.fsum(t.expected_tool_s for t in trajs) / gaps, 9) if gaps else 0.0

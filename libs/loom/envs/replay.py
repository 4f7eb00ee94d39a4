"""Trace replay: the model's action at step k is the recorded action with the recorded completion length.

The context length of each call is the provider's recorded ``prompt_tokens``, which already counts the
history, so prefix caching sees the same growth the real agent produced. The tool's observation comes
back after a modelled latency, log-normal with the job's mean (Heddle Table 1: coding tools 0.41-0.46 s).
The traces hold one run per task. By default (a task's ``"siblings": "varied"``) each sample of a group is a
variation of it, as the coding workload's samples are (``loom.workloads.siblings``: calls and tokens per call
scaled by log-normal factors calibrated to the traces with several trials per task; each call replays a
recorded one, its context grown by the sample's own output); ``"replay"`` replays the recorded run itself,
so the samples differ only in their tool latencies.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loom.data.traces import Trace
from loom.protocol import ToolLatency
from loom.workloads.base import lognormal
from loom.workloads.siblings import vary

SIBLINGS = ("varied", "replay")


@dataclass(frozen=True)
class ReplayCall:
    input_len: int
    max_new_tokens: int
    action: str
    observation: str
    last: bool


class ReplayEnv:
    def __init__(
        self,
        trace: Trace,
        tool_latency: ToolLatency,
        seed: int,
        max_turns: int,
        max_tokens: int,
        siblings: str = "replay",
    ):
        if siblings not in SIBLINGS:
            raise ValueError(f"unknown siblings {siblings!r}; one of {SIBLINGS}")
        self.trace = trace
        self.tool_latency = tool_latency
        self.rng = random.Random(seed)
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        s = trace.steps
        # (recorded step, context, output) per call of this sample.
        self.plan = (
            vary(s, random.Random(f"siblings:{seed}"))
            if siblings == "varied"
            else [(k, st.prompt_tokens, st.completion_tokens) for k, st in enumerate(s)]
        )

    def calls(self) -> list[ReplayCall]:
        """The LLM calls of the episode, cut at ``max_turns`` and at the ``max_tokens`` output budget."""
        out: list[ReplayCall] = []
        budget = self.max_tokens
        plan = self.plan[: self.max_turns]
        for k, (origin, context, tokens) in enumerate(plan):
            s = self.trace.steps[origin]
            n = min(tokens, budget)
            budget -= n
            last = k == len(plan) - 1 or budget <= 0
            out.append(ReplayCall(max(1, context), max(1, n), s.action, s.observation, last))
            if budget <= 0:
                break
        return out

    def finish_reason(self, n_calls: int) -> str:
        if n_calls == len(self.plan):
            return self.trace.exit_status or "done"
        return "max_turns" if n_calls == self.max_turns else "max_tokens"

    def sample_tool_latency(self) -> float:
        return lognormal(self.rng, self.tool_latency.mean_s, self.tool_latency.sigma)

"""Trace replay: the model's action at step k is the recorded action with the recorded completion length.

The context length of each call is the provider's recorded ``prompt_tokens``, which already counts the
history, so prefix caching sees the same growth the real agent produced. The tool's observation comes
back after a modelled latency, log-normal with the job's mean (Heddle Table 1: coding tools 0.41-0.46 s).
Every sample of a group replays the same recorded trajectory: the traces hold one run per task, so the
samples differ only in their tool latencies (documented, not invented variation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loom.protocol import ToolLatency
from loom.traces import Trace
from loom.workloads.base import lognormal


@dataclass(frozen=True)
class ReplayCall:
    input_len: int
    max_new_tokens: int
    action: str
    observation: str
    last: bool


class ReplayEnv:
    def __init__(self, trace: Trace, tool_latency: ToolLatency, seed: int, max_turns: int, max_tokens: int):
        self.trace = trace
        self.tool_latency = tool_latency
        self.rng = random.Random(seed)
        self.max_turns = max_turns
        self.max_tokens = max_tokens

    def calls(self) -> list[ReplayCall]:
        """The LLM calls of the episode, cut at ``max_turns`` and at the ``max_tokens`` output budget."""
        out: list[ReplayCall] = []
        budget = self.max_tokens
        steps = self.trace.steps[: self.max_turns]
        for k, s in enumerate(steps):
            n = min(s.completion_tokens, budget)
            budget -= n
            last = k == len(steps) - 1 or budget <= 0
            out.append(ReplayCall(max(1, s.prompt_tokens), max(1, n), s.action, s.observation, last))
            if budget <= 0:
                break
        return out

    def finish_reason(self, n_calls: int) -> str:
        if n_calls == len(self.trace.steps):
            return self.trace.exit_status or "done"
        return "max_turns" if n_calls == self.max_turns else "max_tokens"

    def sample_tool_latency(self) -> float:
        return lognormal(self.rng, self.tool_latency.mean_s, self.tool_latency.sigma)

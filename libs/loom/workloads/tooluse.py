"""Tool use: tau-bench airline (GPT-4o), 40 tasks x 4 trials: real samples of the same prompt (groups
larger than 4 replay the trials in turn, each replay with its own tool times; ``loom.data.trace_sets``).

What follows a call is either a tool (the airline API, in-process Python: mean 0.05 s like Heddle's math
tools) or the simulated user, itself an LLM whose reply is modelled as 0.3 s plus 20 ms per token of its
message.
"""

from __future__ import annotations

import random
from pathlib import Path

from loom.data.trace_sets import message_tokens, tool_use_traces
from loom.data.traces import Trace, TraceStep
from loom.text.tokenizer import count_tokens
from loom.workloads.base import Workload, group_traces, lognormal, replay

TOOL_MEAN_S = 0.05
USER_BASE_S = 0.3
USER_PER_TOKEN_S = 0.02


def tool_use(
    prompts: int | None = None, group_size: int = 4, seed: int = 0, path: str | Path | None = None
) -> Workload:
    rng = random.Random(seed)

    def env_s(step: TraceStep) -> float:
        if step.env == "tool":
            return lognormal(rng, TOOL_MEAN_S, 0.5)
        if step.env == "user":  # the reply's text and 4 tokens of role and separators
            return USER_BASE_S + USER_PER_TOKEN_S * (count_tokens(step.observation) + 4)
        return 0.0

    def env_mean_s(step: TraceStep) -> float | None:
        return TOOL_MEAN_S if step.env == "tool" else None  # the user's reply time follows from its text

    w = Workload("tool_use", __doc__ or "")
    for prompt, trials in list(group_traces(tool_use_traces(path)).items())[:prompts]:
        policy = [system_message(trace) for trace in trials]
        for s in range(group_size):
            trace = trials[s % len(trials)]
            w.trajectories.append(
                replay(f"{prompt}#{s}", prompt, s, trace, env_s, env_mean_s, system=policy[s % len(trials)])
            )
    return w


def system_message(trace: Trace) -> int:
    """Tokens of the airline policy, the system message every task opens with: the first call's context is it
    and the user's first message, the task (``tool_use_traces`` counts both)."""
    if not trace.steps:
        return 0
    return max(0, trace.steps[0].prompt_tokens - message_tokens({"role": "user", "content": trace.task}))

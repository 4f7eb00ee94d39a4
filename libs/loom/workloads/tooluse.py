"""Tool use: tau-bench airline (GPT-4o), 40 tasks x 4 trials: real samples of the same prompt (groups
larger than 4 replay the trials in turn, each replay with its own tool times).

Each assistant message is one LLM call: its context is every message before it, its output the message's
text and tool calls, counted with the Qwen tokenizer. What follows a call is either a tool (the airline
API, in-process Python: mean 0.05 s like Heddle's math tools) or the simulated user, itself an LLM whose
reply is modelled as 0.3 s plus 20 ms per token of its message.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

from loom.settings import default_shared_dir
from loom.tokenizer import count_tokens
from loom.workloads.base import Workload, WorkStep, WorkTraj, cap_output, lognormal

TOOL_MEAN_S = 0.05
USER_BASE_S = 0.3
USER_PER_TOKEN_S = 0.02


def _tokens(msg: dict[str, Any]) -> int:
    text = msg.get("content") or ""
    if msg.get("tool_calls"):
        text += json.dumps(msg["tool_calls"])
    return count_tokens(text) + 4  # role and separators


def tool_use(
    prompts: int | None = None, group_size: int = 4, seed: int = 0, path: str | Path | None = None
) -> Workload:
    p = Path(path) if path else default_shared_dir() / "data/traces/tau-bench-airline-gpt4o.json.gz"
    with gzip.open(p, "rt", encoding="utf-8") as f:
        records = json.load(f)
    tasks: dict[int, list[dict[str, Any]]] = {}
    for r in sorted(records, key=lambda r: (r["task_id"], r["trial"])):
        tasks.setdefault(r["task_id"], []).append(r)
    rng = random.Random(seed)
    w = Workload("tool_use", __doc__ or "")
    for task_id in list(tasks)[:prompts]:
        trials = tasks[task_id]
        # More samples than recorded trials replay the trials in turn, with their own tool times.
        for s in range(group_size):
            rec = trials[s % len(trials)]
            msgs = rec["traj"]
            context, steps = 0, []
            for i, m in enumerate(msgs):
                n = _tokens(m)
                if m["role"] == "assistant":
                    nxt = msgs[i + 1] if i + 1 < len(msgs) else None
                    if nxt is None:
                        env = 0.0
                    elif nxt["role"] == "tool":
                        env = lognormal(rng, TOOL_MEAN_S, 0.5)
                    else:
                        env = USER_BASE_S + USER_PER_TOKEN_S * _tokens(nxt)
                    steps.append(WorkStep(max(1, context), max(1, n), env))
                context += n
            if steps:
                reward = float(rec.get("reward") or 0.0)
                w.trajectories.append(
                    WorkTraj(f"tau{task_id}#{s}", f"tau{task_id}", s, cap_output(steps), reward)
                )
    return w

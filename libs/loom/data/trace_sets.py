"""The three recorded trace sets as ``Trace`` objects, text and token counts alike: coding (SWE-bench, one run
per task), search (HotpotQA ReAct, 5 trials per question) and tool use (tau-bench airline, 4 trials per
task). The workloads replay them and the length predictor trains on them; trials of one prompt share the id
up to ``#trial``.

Search and tool use carry no token counts: each call and observation is counted with the Qwen tokenizer.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from loom.data.traces import HOTPOTQA_LOGS, Trace, TraceStep, load_traces, open_text, prompt_of
from loom.settings import default_shared_dir
from loom.text.tokenizer import count_tokens

SETS = ("coding", "search", "tool_use")
TAU_TRACES = "data/traces/tau-bench-airline-gpt4o.json.gz"
_STEP = re.compile(r"^(Thought|Action|Observation) (\d+): ?(.*)$")


def parse_runs(text: str) -> list[tuple[str, list[tuple[str, str]], bool]]:
    """(question, [(thought+action, observation)], correct) for every run in a ReAct log."""
    runs = []
    question: str | None = None
    steps: list[list[str]] = []
    correct = False
    for line in [*text.splitlines(), "Question: <end>"]:
        if line.startswith("Question:") or line.startswith("BEGIN TRIAL") or line.startswith("#####"):
            if question is not None and steps:
                runs.append((question, [(a, o) for a, o in steps], correct))
            question = line[len("Question:") :].strip() if line.startswith("Question:") else None
            steps, correct = [], False
            continue
        m = _STEP.match(line)
        if question is None:
            continue
        if m:
            kind, _, body = m.groups()
            if kind == "Thought":
                steps.append([line, ""])
            elif kind == "Action" and steps:
                steps[-1][0] += "\n" + line
            elif kind == "Observation" and steps:
                steps[-1][1] = body
                correct = correct or "Answer is CORRECT" in body
        elif steps and line and not line.startswith(("Correct answer:", "-----")):
            steps[-1][1] += "\n" + line  # an observation that spans lines
    return runs


@functools.lru_cache(maxsize=2)
def search_traces(path: str | Path | None = None) -> tuple[Trace, ...]:
    """Every ReAct run as a trace, ``q{n}#{trial}``: each "Thought k / Action k" is one call, its context the
    question and everything before it in the log (the few-shot prompt is not in the logs: not counted)."""
    p = Path(path) if path else HOTPOTQA_LOGS
    with open_text(p) as f:
        runs = parse_runs(f.read())
    by_question: dict[str, list[tuple[list[tuple[str, str]], bool]]] = defaultdict(list)
    for q, steps, ok in runs:
        by_question[q].append((steps, ok))
    out = []
    for n, (q, trials) in enumerate(by_question.items()):
        task = "Question: " + q
        for trial, (steps, ok) in enumerate(trials):
            context, recorded = count_tokens(task), []
            for call, observation in steps:
                k = count_tokens(call)
                recorded.append(TraceStep(context, k, call, observation, 0, "tool"))
                context += k + count_tokens(observation)
            out.append(Trace(f"q{n}#{trial}", ok, "", tuple(recorded), task))
    return tuple(out)


def message_tokens(msg: dict[str, Any]) -> int:
    """A chat message's tokens: its text and tool calls, and 4 for the role and separators."""
    text = msg.get("content") or ""
    if msg.get("tool_calls"):
        text += json.dumps(msg["tool_calls"])
    return count_tokens(text) + 4


@functools.lru_cache(maxsize=2)
def tool_use_traces(path: str | Path | None = None) -> tuple[Trace, ...]:
    """Every tau-bench trial as a trace, ``tau{task}#{trial}``: each assistant message is one call, its context
    every message before it; its observation is what follows it up to the next call (tool results, or the
    simulated user's reply, ``env`` says which). The task statement is the user's first message (the
    system message, the airline policy, is the same for every task)."""
    p = Path(path) if path else default_shared_dir() / TAU_TRACES
    with gzip.open(p, "rt", encoding="utf-8") as f:
        records = json.load(f)
    out = []
    for r in sorted(records, key=lambda r: (r["task_id"], r["trial"])):
        msgs = r["traj"]
        task = next((m.get("content") or "" for m in msgs if m["role"] == "user"), "")
        context, recorded = 0, []
        for i, m in enumerate(msgs):
            n = message_tokens(m)
            if m["role"] == "assistant":
                after = []
                for nxt in msgs[i + 1 :]:
                    if nxt["role"] == "assistant":
                        break
                    after.append(nxt)
                action = (m.get("content") or "") + (
                    json.dumps(m["tool_calls"]) if m.get("tool_calls") else ""
                )
                observation = "\n".join(x.get("content") or "" for x in after)
                env = after[0]["role"] if after else ""
                recorded.append(TraceStep(max(1, context), max(1, n), action, observation, 0, env))
            context += n
        if recorded:
            ok = bool(r.get("reward"))
            out.append(Trace(f"tau{r['task_id']}#{r['trial']}", ok, "", tuple(recorded), task))
    return tuple(out)


def trace_set(name: str, path: str | Path | None = None) -> tuple[Trace, ...]:
    if name == "coding":
        return tuple(load_traces(path).values())
    if name == "search":
        return search_traces(path)
    if name == "tool_use":
        return tool_use_traces(path)
    raise ValueError(f"unknown trace set {name!r}; one of {SETS}")


def workload_of_prompts() -> dict[str, str]:
    """The trace set each prompt of the three belongs to."""
    return {prompt_of(t): name for name in SETS for t in trace_set(name)}

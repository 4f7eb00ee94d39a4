"""Search: ReAct agents on HotpotQA (100 questions x 5 trials, Reflexion's logs).

Each "Thought k / Action k" is one LLM call; its context is the question and everything before it in the
log, its output the thought and action, counted with the Qwen tokenizer. (The ReAct few-shot prompt is not
in the logs and is not counted.) The trials of a question are the samples of its group: real runs of
the same prompt, though the logged agent was nearly deterministic, so only 26 of the 100 groups differ
between trials. Groups larger than the 5 trials (GRPO's 16) replay the trials in turn, each replay with
its own tool times. Tool time is the search agent's (Heddle Table 1: 1.41-1.43 s per call).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from pathlib import Path

from loom.envs import hotpotqa
from loom.tokenizer import count_tokens
from loom.traces import open_text
from loom.workloads.base import Workload, WorkStep, WorkTraj, cap_output, lognormal

TOOL_MEAN_S = 1.42
TOOL_SIGMA = 0.5
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


def search(
    prompts: int | None = None, group_size: int = 5, seed: int = 0, path: str | Path | None = None
) -> Workload:
    p = Path(path) if path else hotpotqa.DEFAULT_PATH
    with open_text(p) as f:
        runs = parse_runs(f.read())
    by_question: dict[str, list[tuple[list[tuple[str, str]], bool]]] = defaultdict(list)
    for q, steps, ok in runs:
        by_question[q].append((steps, ok))
    rng = random.Random(seed)
    w = Workload("search", __doc__ or "")
    for q in list(by_question)[:prompts]:
        question_tokens = count_tokens("Question: " + q)
        trials = by_question[q]
        # More samples than recorded trials replay the trials in turn, with their own tool times.
        for s in range(group_size):
            steps, ok = trials[s % len(trials)]
            context, out = question_tokens, []
            for call, observation in steps:
                n = count_tokens(call)
                out.append(WorkStep(context, n, lognormal(rng, TOOL_MEAN_S, TOOL_SIGMA)))
                context += n + count_tokens(observation)
            w.trajectories.append(
                WorkTraj(f"q{len(w.trajectories)}", q, s, cap_output(out), 1.0 if ok else 0.0)
            )
    return w

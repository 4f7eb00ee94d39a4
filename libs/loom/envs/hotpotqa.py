"""HotpotQA from Reflexion's ReAct logs: questions with their gold answers, the agent's successful
action sequences, and a local corpus of the Wikipedia paragraphs its Search calls returned.

The logs hold, per question and trial, ``Question:``, ``Thought k / Action k / Observation k`` lines and
``Correct answer: ...``. A ``Search[title]`` whose observation is a paragraph (not "Could not find")
becomes the corpus document ``title``; the corpus is what the search environment searches with BM25.
"""

from __future__ import annotations

import functools
import re
import string
from pathlib import Path

from msgspec import Struct

from loom.data.traces import HOTPOTQA_LOGS, open_text

DEFAULT_PATH = HOTPOTQA_LOGS
_LINE = re.compile(r"^(Thought|Action|Observation) (\d+): ?(.*)$")
_ACTION = re.compile(r"^(\w+)\[(.*)\]$")


class Doc(Struct, frozen=True):
    title: str
    text: str


class QA(Struct, frozen=True):
    id: str
    question: str
    answer: str
    # The ReAct actions of a run the logs judged correct (empty if no trial got it right).
    reference: list[str]


class Corpus(Struct, frozen=True):
    docs: list[Doc]
    questions: list[QA]


def _parse(text: str) -> Corpus:
    docs: dict[str, str] = {}
    answers: dict[str, str] = {}
    reference: dict[str, list[str]] = {}
    order: list[str] = []
    question: str | None = None
    actions: list[str] = []
    pending: str | None = None  # the Search title whose observation comes next

    def close_run(correct: bool) -> None:
        if question is not None and correct and actions and question not in reference:
            reference[question] = list(actions)

    correct = False
    for line in text.splitlines():
        if line.startswith("Question:"):
            close_run(correct)
            question = line[len("Question:") :].strip()
            if question not in answers and question not in order:
                order.append(question)
            actions, correct, pending = [], False, None
            continue
        if question is None:
            continue
        if line.startswith("Correct answer:"):
            answers.setdefault(question, line[len("Correct answer:") :].strip())
            continue
        m = _LINE.match(line)
        if not m:
            continue
        kind, _, body = m.groups()
        if kind == "Action":
            actions.append(body.strip())
            a = _ACTION.match(body.strip())
            pending = a.group(2).strip() if a and a.group(1) == "Search" else None
        elif kind == "Observation":
            correct = correct or "Answer is CORRECT" in body
            if pending and not body.startswith("Could not find") and body.strip():
                docs.setdefault(pending, body.strip())
            pending = None
    close_run(correct)
    qas = [QA(f"hotpotqa/{i}", q, answers.get(q, ""), reference.get(q, [])) for i, q in enumerate(order)]
    return Corpus([Doc(t, x) for t, x in docs.items()], [q for q in qas if q.answer])


@functools.cache
def load(path: str | Path | None = None) -> Corpus:
    p = Path(path) if path else DEFAULT_PATH
    if not p.exists():
        raise FileNotFoundError(f"{p} is missing: the search environment reads the HotpotQA ReAct logs")
    with open_text(p) as f:
        return _parse(f.read())


def normalize(answer: str) -> str:
    """HotpotQA's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    s = answer.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize(prediction) == normalize(gold)

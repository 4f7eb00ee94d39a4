"""Task sets with ground truth from ``../shared/data/tasks``: HumanEval, MBPP (Python) and GSM8K."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

from msgspec import Struct

from loom.settings import default_shared_dir
from loom.traces import open_text

TASKS = default_shared_dir() / "data" / "tasks"
FILES = {
    "humaneval": "HumanEval.jsonl.gz",
    "mbpp": "mbpp-py.jsonl",
    "gsm8k": "gsm8k-test.jsonl",
    "gsm8k-train": "gsm8k-train.jsonl.gz",
}


class CodeTask(Struct, frozen=True):
    id: str
    prompt: str
    entry_point: str
    test: str
    # The canonical body that completes ``prompt`` (HumanEval has one; this MBPP export does not).
    reference: str | None = None

    def program(self, completion: str) -> str:
        """The file the tests run on a completion of the prompt (the HumanEval convention)."""
        return self.test_program(self.prompt + completion)

    def test_program(self, source: str) -> str:
        """The file the tests run on complete source: the source, the tests, and the call to them."""
        call = "" if re.search(r"^test_check\(\)", self.test, re.M) else f"\ncheck({self.entry_point})\n"
        return f"{source}\n\n{self.test}\n{call}"


class MathTask(Struct, frozen=True):
    id: str
    question: str
    solution: str
    answer: str


def _lines(path: Path) -> Iterator[dict[str, object]]:
    with open_text(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _path(name: str, path: str | Path | None) -> Path:
    if path is not None:
        return Path(path)
    if name not in FILES:
        raise KeyError(f"unknown task set {name!r}; known: {sorted(FILES)}")
    p = TASKS / FILES[name]
    if not p.exists():
        raise FileNotFoundError(f"{p} is missing: task sets are read from ../shared/data/tasks")
    return p


@functools.cache
def humaneval(path: str | Path | None = None) -> dict[str, CodeTask]:
    out = {}
    for d in _lines(_path("humaneval", path)):
        t = CodeTask(
            str(d["task_id"]),
            str(d["prompt"]),
            str(d["entry_point"]),
            str(d["test"]),
            str(d["canonical_solution"]),
        )
        out[t.id] = t
    return out


@functools.cache
def mbpp(path: str | Path | None = None) -> dict[str, CodeTask]:
    out = {}
    for d in _lines(_path("mbpp", path)):
        t = CodeTask(str(d["name"]), str(d["prompt"]), str(d["entry_point"]), str(d["test"]))
        out[t.id] = t
    return out


def final_answer(solution: str) -> str:
    """GSM8K's answer: what follows ``####``, without thousands separators."""
    m = re.search(r"####\s*(.+?)\s*$", solution.strip())
    if m is None:
        raise ValueError("no '#### answer' line in the solution")
    return m.group(1).replace(",", "").strip()


@functools.cache
def gsm8k(path: str | Path | None = None, split: str = "test") -> dict[str, MathTask]:
    name = "gsm8k" if split == "test" else "gsm8k-train"
    out = {}
    for i, d in enumerate(_lines(_path(name, path))):
        sol = str(d["answer"])
        t = MathTask(f"gsm8k-{split}/{i}", str(d["question"]), sol, final_answer(sol))
        out[t.id] = t
    return out

"""Task sets with ground truth from ``../shared/data/tasks`` (HumanEval, MBPP, GSM8K), and generated arithmetic."""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

from msgspec import Struct

from loom.data.traces import open_text
from loom.settings import default_shared_dir

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


# ---------------------------------------------------------------- generated arithmetic (``arith``)

# Training and held-out sets: their own seeds, and the held-out questions are excluded from training (checked).
ARITH_SIZES = {"train": 4096, "eval": 512}
_ARITH_SEEDS = {"train": 0xA817_0001, "eval": 0xA817_0E7A}
# a * b + c with 3-digit numbers and a 6-digit answer: no one (least of all a tiny model) multiplies that in
# their head, so the calculator is needed, and the model's part is to copy numbers: the operands into the
# tool call, the printed result into Finish. Fixed lengths put every copy at a fixed offset, which a small
# model learns in minutes (with 3-4 digits and varying lengths it needs several times as many steps).
ARITH_RANGE = (100, 999)
ARITH_ANSWER_DIGITS = 6


def _arith_questions(split: str, n: int, exclude: frozenset[str]) -> list[tuple[int, int, int]]:
    rng = random.Random(_ARITH_SEEDS[split])
    lo, hi = ARITH_RANGE
    seen: set[str] = set()
    out: list[tuple[int, int, int]] = []
    while len(out) < n:
        a, b, c = rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi)
        q = arith_question(a, b, c)
        if len(str(a * b + c)) != ARITH_ANSWER_DIGITS or q in seen or q in exclude:
            continue
        seen.add(q)
        out.append((a, b, c))
    return out


def arith_question(a: int, b: int, c: int) -> str:
    """The question, with the expression written as the calculator takes it."""
    return f"What is {a}*{b}+{c}?"


@functools.cache
def arith(split: str = "train") -> dict[str, MathTask]:
    """Generated arithmetic for the math environment, deterministic: ``What is a*b+c?`` with a GSM8K-style
    solution (``<<a*b+c=r>>``), so its reference script is one calculator call and ``Finish[r]``.

    ``train`` (data set ``arith``) and ``eval`` (``arith-eval``) use different seeds, and no held-out
    question appears in training."""
    if split not in ARITH_SIZES:
        raise KeyError(f"unknown arith split {split!r}; known: {sorted(ARITH_SIZES)}")
    held_out = _arith_questions("eval", ARITH_SIZES["eval"], frozenset())
    if split == "eval":
        chosen = held_out
    else:
        chosen = _arith_questions(
            "train", ARITH_SIZES["train"], frozenset(arith_question(*t) for t in held_out)
        )
    name = "arith" if split == "train" else "arith-eval"
    out = {}
    for i, (a, b, c) in enumerate(chosen):
        r = a * b + c
        sol = f"{a} * {b} + {c} = <<{a}*{b}+{c}={r}>>{r}\n#### {r}"
        t = MathTask(f"{name}/{i}", arith_question(a, b, c), sol, str(r))
        out[t.id] = t
    return out


def records(path: str | Path) -> dict[str, dict[str, object]]:
    """Tasks of a user environment or an external agent: one JSON object per line (gzip too), keyed by its
    ``id`` (a string), else by its line number. ValueError names the first bad line."""
    out: dict[str, dict[str, object]] = {}
    with open_text(Path(path)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e.msg}") from e
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: a task is a JSON object")
            rid = rec.get("id", f"line{n}")
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"{path}:{n}: a task's id is a non-empty string")
            if rid in out:
                raise ValueError(f"{path}:{n}: task id {rid!r} appears twice")
            out[rid] = rec
    if not out:
        raise ValueError(f"{path} holds no tasks")
    return out

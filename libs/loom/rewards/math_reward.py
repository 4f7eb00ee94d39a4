"""Math reward: the final answer extracted from the response and checked for equivalence with math-verify
(LaTeX, \\boxed{}, fractions, expressions), with an exact rational comparison of plain numbers first."""

from __future__ import annotations

import logging
import re
from fractions import Fraction

from math_verify import parse, verify

from loom.protocol import RewardRequest
from loom.rewards.context import RewardContext, RewardError, call_argument, ground_truth, response_text

# It warns on every call that its timeouts are off; the deadline is the reward service's (see math_score).
logging.getLogger("math_verify").setLevel(logging.ERROR)

_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)
_PLAIN = re.compile(r"^\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)\s*%?\s*$")


def extract_answer(text: str) -> str:
    """The part of a response that states the answer: GSM8K's ``#### x``, a ``Finish``/``answer`` call, or
    the whole text (math-verify then finds \\boxed{} or the last expression)."""
    m = _GSM8K.search(text.strip())
    if m:
        return m.group(1)
    arg = call_argument(text, ("finish", "answer", "submit"))
    return arg if arg is not None else text


def _plain_number(text: str) -> Fraction | None:
    m = _PLAIN.match(text)
    return Fraction(m.group(1).replace(",", "")) if m else None


def math_score(response: str, gold: str) -> float:
    answer = extract_answer(response)
    a, b = _plain_number(answer), _plain_number(gold)
    if a is not None and b is not None:
        return float(a == b)
    # Timeouts off: math-verify's are SIGALRM-based (main thread only); the reward service's per-request
    # deadline kills a worker stuck in sympy instead.
    g = parse(gold.replace(",", "") if b is not None else gold, parsing_timeout=None)
    p = parse(answer, parsing_timeout=None)
    if not g:
        raise RewardError(f"the gold answer {gold!r} does not parse")
    return float(bool(p) and verify(g, p, timeout_seconds=None))


def math_reward(req: RewardRequest, ctx: RewardContext) -> float:
    gold = ground_truth(req)
    if not isinstance(gold, str | int | float):
        raise RewardError(f"math reward needs a textual gold answer, got {type(gold).__name__}")
    return math_score(response_text(req.trajectory), str(gold))

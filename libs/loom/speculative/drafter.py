"""Suffix-match (n-gram) drafting over several token corpora, with a draft length that follows acceptance.

A draft is what followed the longest recent match of the context's last tokens: the vLLM and SGLang n-gram
proposers do this over the request's own tokens; Seer over the group's siblings, RhymeRL over the prompt's
previous epoch. Here each corpus is a ``SuffixIndex`` and a ``Drafter`` picks among their matches.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_N = 2
MAX_N = 8
MOST = 8  # drafted tokens per step at most
# A token is drafted while the chance that it and every one before it is accepted stays above this: about
# what one more position adds to a verification step at batch 32-64 on the H200 (engine/model/measured/README.md).
THRESHOLD = 0.1
PRIOR = 0.5  # a corpus's acceptance before it has drafted
WEIGHT = 0.2  # of the latest step in a corpus's running acceptance
RELAX = 0.02  # per matched step without a draft, of the way back to PRIOR


class SuffixIndex:
    """Token sequences that grow at their ends, indexed by every n-gram (``min_n`` <= n <= ``max_n``) that
    some token follows: each n-gram maps to where its latest occurrence's continuation starts. An n-gram at
    the very end of a sequence is indexed once its next token arrives, so a context never matches itself."""

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.seqs: list[list[int]] = []
        self._at: dict[tuple[int, ...], tuple[int, int]] = {}

    def add(self, tokens: Sequence[int] = ()) -> int:
        """A new sequence; its id."""
        self.seqs.append([])
        sid = len(self.seqs) - 1
        self.extend(sid, tokens)
        return sid

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        seq, at = self.seqs[sid], self._at
        lo, hi = self.min_n, self.max_n
        for t in tokens:
            p = len(seq)
            for n in range(lo, min(hi, p) + 1):
                at[tuple(seq[p - n : p])] = (sid, p)
            seq.append(t)

    def match(self, tail: Sequence[int]) -> tuple[int, int, int] | None:
        """(n, sequence, continuation start) of the longest n-gram ending ``tail`` that occurs here, at its
        latest occurrence; None if not even ``min_n`` tokens match."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            hit = self._at.get(tuple(tail[len(tail) - n :]))
            if hit is not None:
                return n, hit[0], hit[1]
        return None

    def continuation(self, sid: int, start: int, k: int) -> list[int]:
        return self.seqs[sid][start : start + k]


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    source: str = ""
    rate: float = PRIOR  # the source's running acceptance when it drafted: each token's chance, estimated


def expected_kept(p: float, k: int) -> float:
    """Tokens kept of a k-token draft whose tokens are each accepted with probability p, until the first
    rejection: p + p^2 + ... + p^k."""
    return k * p if p >= 1.0 else p * (1 - p**k) / (1 - p)


def draft_length(p: float, most: int = MOST, threshold: float = THRESHOLD) -> int:
    """The longest draft whose last token is accepted with all before it with probability >= threshold: 0
    when even one token is not worth verifying."""
    if p < threshold:
        return 0
    if p >= 1.0:
        return most
    return min(most, int(math.log(threshold) / math.log(p)))


class Drafter:
    """Drafts from named corpora. Each corpus keeps a running estimate of how often its drafted tokens are
    accepted; a step drafts from the matching corpus that promises the most kept tokens (ties: the longer
    match, then the corpus listed first), as long as that estimate allows. ``fixed`` drafts that many
    tokens from the longest match instead."""

    def __init__(self, corpora: Sequence[tuple[str, SuffixIndex]], fixed: int | None = None) -> None:
        self.corpora = list(corpora)
        self.fixed = fixed
        self.rate = {name: PRIOR for name, _ in corpora}

    def draft(self, tail: Sequence[int]) -> Draft:
        best: tuple[float, int, int] | None = None
        chosen: Draft = Draft([])
        for order, (name, corpus) in enumerate(self.corpora):
            m = corpus.match(tail)
            if m is None:
                continue
            n, sid, start = m
            if self.fixed is not None:
                key, k = (float(n), 0, -order), self.fixed
            else:
                k = draft_length(self.rate[name])
                if k == 0:
                    # Not drafting, this corpus learns nothing new: its estimate drifts back toward the prior
                    # so that it is tried again after a while (its drafts may have become good).
                    self.rate[name] += RELAX * (PRIOR - self.rate[name])
                    continue
                key = (expected_kept(self.rate[name], k), n, -order)
            if best is None or key > best:
                tokens = _chained(corpus, tail, corpus.continuation(sid, start, k), k)
                best, chosen = key, Draft(tokens, name, self.rate[name])
        return chosen

    def feedback(self, draft: Draft, kept: int) -> None:
        """A verification kept ``kept`` of the draft's tokens: each kept one counts as accepted and the
        first refused one, if any, as rejected."""
        if not draft.tokens:
            return
        trials = kept + (kept < len(draft.tokens))
        r = self.rate[draft.source]
        self.rate[draft.source] = (1 - WEIGHT) * r + WEIGHT * (kept / trials)


def _chained(corpus: SuffixIndex, tail: Sequence[int], draft: list[int], k: int) -> list[int]:
    """A continuation cut short by the end of its sequence (the latest occurrence of a repeated phrase is
    the one just before the end) continues from the match of the context with the draft so far."""
    while 0 < len(draft) < k:
        m = corpus.match([*tail, *draft][-corpus.max_n :])
        if m is None:
            break
        more = corpus.continuation(m[1], m[2], k - len(draft))
        if not more:
            break
        draft = draft + more
    return draft


@dataclass
class Tally:
    """Verification steps and what their drafts did; ``tokens`` counts what the steps emitted."""

    steps: int = 0
    drafting_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    # Steps by the number of drafted tokens they kept.
    kept: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, drafted: int, kept: int) -> None:
        """One verification step that drafted ``drafted`` tokens and kept ``kept`` of them."""
        self.steps += 1
        self.drafting_steps += drafted > 0
        self.drafted += drafted
        self.accepted += kept
        self.kept[kept] += 1

    def add(self, other: Tally) -> None:
        self.steps += other.steps
        self.drafting_steps += other.drafting_steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.tokens += other.tokens
        for k, v in other.kept.items():
            self.kept[k] += v

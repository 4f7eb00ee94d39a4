"""Okapi BM25 over a small in-memory corpus (the HotpotQA paragraphs), with an inverted index."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

_WORD = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75) -> None:
        self.k1, self.b = k1, b
        self.n = len(docs)
        self.lengths = [0] * self.n
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, d in enumerate(docs):
            tf = Counter(tokens(d))
            self.lengths[i] = sum(tf.values())
            for t, c in tf.items():
                self.postings[t].append((i, c))
        self.avgdl = (sum(self.lengths) / self.n) if self.n else 0.0

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1.0 + (self.n - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> dict[int, float]:
        out: dict[int, float] = defaultdict(float)
        for t in set(tokens(query)):
            idf = self.idf(t)
            for i, tf in self.postings.get(t, ()):
                norm = tf + self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avgdl)
                out[i] += idf * tf * (self.k1 + 1) / norm
        return out

    def top(self, query: str, k: int = 5) -> list[tuple[int, float]]:
        """The k best documents, best first; ties go to the earlier document."""
        s = self.scores(query)
        return sorted(s.items(), key=lambda x: (-x[1], x[0]))[:k]

"""The language model both simulated servers sample from: a real next-token distribution, so that what a server
reports as a token's log-prob can be checked against the distribution a trainer would compute.

The model is a bigram over Qwen3's ordinary vocabulary: after token ``p``, ``CANDIDATES`` tokens drawn from a hash
of ``p`` (among ``SUPPORT`` ids spread over the vocabulary) carry logits in [0, ``SPREAD``], and every other token the logit
``BACKGROUND``, so the normaliser is known in closed form, whatever the vocabulary, and a context's table under one
sampling is built once. On top of it each step applies
what a request's sampling fields do in vLLM's sampler, in its order: the repetition penalty over the prompt's
and output's tokens (a logit above 0 divided by it, else multiplied), the frequency and presence penalties over
the output's, the temperature, then min-p, top-k and top-p truncation, each renormalised (SGLang's penalisers are
the same; it truncates top-k, top-p, then min-p, which differs only where several are set).

Simplifications, none of which a client can tell from a real server: the penalties move candidates only (a
background token keeps its logit however often it appears), and truncation ranks the background after every
candidate and keeps or drops it whole.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from loom.engine.token_ids import QWEN3_ORDINARY, synth_ids

CANDIDATES = 64
SPREAD = 3.0
BACKGROUND = -8.0
SUPPORT = 1024  # candidates are drawn from this many ids, so that contexts recur and their tables are reused
_UNIT = 2.0**-32
_REST = math.log(QWEN3_ORDINARY - CANDIDATES)  # the background's tokens, taken as one entry of that many


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's effective sampling fields; ``top_k`` 0 (or -1) keeps every token."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Step(NamedTuple):
    """One sampled token: its log-prob under the raw distribution (vLLM's ``raw_logprobs``), under the penalised
    distribution at the temperature (SGLang's), and under the one it was drawn from (vLLM's
    ``processed_logprobs``), with the ``top`` alternatives of each, best first. (A tuple: a long output is
    hundreds of thousands of them, drawn while the server answers.)"""

    token: int
    raw: float
    scaled: float
    processed: float
    top_raw: Sequence[tuple[int, float]] = ()
    top_scaled: Sequence[tuple[int, float]] = ()
    top_processed: Sequence[tuple[int, float]] = ()


def candidates(prev: int) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """The tokens that may follow ``prev`` above the background, distinct, with their raw logits, best first,
    and the raw distribution's log-normaliser."""
    return _candidates(prev % SUPPORT)


@functools.cache
def _support() -> tuple[int, ...]:
    """The ids candidates are drawn from: spread over the whole vocabulary (the first ids are mostly single
    characters and punctuation, which read as no text a model writes)."""
    ids: dict[int, None] = {}
    draw = 0
    while len(ids) < SUPPORT:
        ids.update(dict.fromkeys(synth_ids(f"lm/support/{draw}", SUPPORT, vocab=QWEN3_ORDINARY)))
        draw += 1
    return tuple(ids)[:SUPPORT]


@functools.lru_cache(maxsize=SUPPORT)
def _candidates(prev: int) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    support = _support()
    ids: list[int] = []
    draw = 0
    while len(ids) < CANDIDATES:
        for k in synth_ids(f"lm/{prev}/{draw}", CANDIDATES, vocab=SUPPORT):
            if support[k] not in ids and len(ids) < CANDIDATES:
                ids.append(support[k])
        draw += 1
    words = synth_ids(f"lm/{prev}/logits", CANDIDATES, vocab=2**32)
    ranked = sorted(zip(ids, (SPREAD * w * _UNIT for w in words), strict=True), key=lambda e: -e[1])
    logits = tuple(lg for _, lg in ranked)
    return tuple(t for t, _ in ranked), logits, _logsumexp([*logits, BACKGROUND + _REST])


def raw_logprob(prev: int, token: int) -> float:
    """log p(``token`` | ``prev``) of the model itself, what a prompt position's log-prob reports."""
    ids, logits, z = candidates(prev)
    return (logits[ids.index(token)] if token in ids else BACKGROUND) - z


def raw_top(prev: int, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens after ``prev`` with their raw log-probs, best first."""
    ids, logits, z = candidates(prev)
    return [(t, lg - z) for t, lg in zip(ids[:k], logits[:k], strict=True)]


@dataclass(frozen=True, slots=True)
class _Table:
    """One context's distributions under one sampling: candidates best first (after penalties), each one's
    log-probs, and the cumulative mass of what truncation keeps, the background last if kept."""

    ids: tuple[int, ...]
    raw: tuple[float, ...]
    scaled: tuple[float, ...]
    processed: tuple[float, ...]
    cdf: tuple[float, ...]
    background: tuple[float, float, float] | None  # raw, scaled, processed log-prob of one background token
    bg_raw: float
    bg_scaled: float
    # Each distribution's alternatives, best first, as (id, log-prob): a draw's top-k is a slice of them.
    top_raw: tuple[tuple[int, float], ...]
    top_scaled: tuple[tuple[int, float], ...]
    top_processed: tuple[tuple[int, float], ...]


def sample(prompt: Sequence[int], n: int, sampling: Sampling, seed: str, top: int = 0) -> list[Step]:
    """``n`` tokens after ``prompt`` drawn under ``sampling``, each by a uniform that is a hash of ``seed`` and
    the position, so that one seed gives one continuation."""
    prev = prompt[-1] if prompt else 0
    words = synth_ids(seed, 2 * n, vocab=2**32)
    # Penalties move the logits by what was seen, so each step gets a table of its own; without them a
    # context's table is built once (and looked up here without hashing the sampling again).
    seen = set(prompt) if sampling.penalised else None
    counts: Counter[int] = Counter()
    tables: dict[int, _Table] = {}
    steps: list[Step] = []
    for i in range(n):
        if seen is not None:
            t = _penalised_table(prev, sampling, seen, counts)
        else:
            t = tables.get(prev % SUPPORT) or tables.setdefault(
                prev % SUPPORT, _table(prev % SUPPORT, sampling)
            )
        step = _draw(t, (words[2 * i] + 0.5) * _UNIT, (words[2 * i + 1] + 0.5) * _UNIT, top)
        steps.append(step)
        if seen is not None:
            seen.add(step.token)
            counts[step.token] += 1
        prev = step.token
    return steps


@functools.lru_cache(maxsize=2 * SUPPORT)
def _table(prev: int, s: Sampling) -> _Table:
    ids, raw, _ = candidates(prev)
    return _build(ids, raw, raw, s)


def _penalised_table(prev: int, s: Sampling, seen: set[int], counts: Counter[int]) -> _Table:
    ids, raw, _ = candidates(prev)
    logits = []
    for t, lg in zip(ids, raw, strict=True):
        if t in seen:
            lg = lg / s.repetition_penalty if lg > 0 else lg * s.repetition_penalty
        if counts.get(t):
            lg -= s.frequency_penalty * counts[t] + s.presence_penalty
        logits.append(lg)
    ranked = sorted(zip(ids, raw, logits, strict=True), key=lambda e: -e[2])
    return _build(tuple(e[0] for e in ranked), tuple(e[1] for e in ranked), tuple(e[2] for e in ranked), s)


def _build(ids: tuple[int, ...], raw: tuple[float, ...], logits: tuple[float, ...], s: Sampling) -> _Table:
    """``logits`` (penalised, best first) of ``ids`` under ``s``'s temperature and truncation."""
    greedy = s.temperature < 1e-5
    temperature = 1.0 if greedy else s.temperature
    z_raw = _logsumexp([*raw, BACKGROUND + _REST])
    scaled = [lg / temperature for lg in logits]
    background = BACKGROUND / temperature
    z_scaled = _logsumexp([*scaled, background + _REST])
    kept, bg = _truncate([lg - z_scaled for lg in scaled], background - z_scaled, s, greedy)
    z_kept = _logsumexp(scaled[:kept] + ([background + _REST] if bg else []))
    cdf, acc = [], 0.0
    for lg in scaled[:kept]:
        acc += math.exp(lg - z_kept)
        cdf.append(acc)
    raw_lps = tuple(lg - z_raw for lg in raw)
    scaled_lps = tuple(lg - z_scaled for lg in scaled)
    processed = tuple(lg - z_kept for lg in scaled[:kept])
    return _Table(
        ids=ids,
        raw=raw_lps,
        scaled=scaled_lps,
        processed=processed,
        cdf=tuple(cdf),
        background=(BACKGROUND - z_raw, background - z_scaled, background - z_kept) if bg else None,
        bg_raw=BACKGROUND - z_raw,
        bg_scaled=background - z_scaled,
        top_raw=tuple(sorted(zip(ids, raw_lps, strict=True), key=lambda e: -e[1])),
        top_scaled=tuple(zip(ids, scaled_lps, strict=True)),
        top_processed=tuple(zip(ids, processed, strict=False)),
    )


def _draw(t: _Table, u: float, u_background: float, top: int) -> Step:
    j = bisect.bisect_right(t.cdf, u)
    if j < len(t.cdf) or t.background is None:
        j = min(j, len(t.cdf) - 1)
        token, raw, scaled, processed = t.ids[j], t.raw[j], t.scaled[j], t.processed[j]
    else:
        token = _background_token(t.ids, u_background)
        raw, scaled, processed = t.background
    if not top:
        return Step(token, raw, scaled, processed)
    return Step(token, raw, scaled, processed, t.top_raw[:top], t.top_scaled[:top], t.top_processed[:top])


def _truncate(logprobs: list[float], background: float, s: Sampling, greedy: bool) -> tuple[int, bool]:
    """How many of the candidates (log-probs at the temperature, best first) vLLM's min-p, then top-k, then
    top-p keep, and whether the background (``background`` each) stays."""
    if greedy:
        return 1, False
    kept, bg = len(logprobs), True
    if s.min_p > 0.0:
        floor = math.log(s.min_p) + logprobs[0]
        kept = sum(1 for lp in logprobs if lp >= floor)
        bg = background >= floor
    if s.top_k not in (0, -1) and s.top_k <= kept:
        kept, bg = s.top_k, False
    if s.top_p < 1.0:
        # The fewest best tokens whose mass, renormalised over what is kept, reaches top_p (vLLM masks those
        # whose ascending cumulative mass stays within 1 - top_p), at least one.
        z = _logsumexp(logprobs[:kept] + ([background + _REST] if bg else []))
        acc = 0.0
        for j in range(kept):
            acc += math.exp(logprobs[j] - z)
            if acc >= s.top_p:
                kept, bg = j + 1, False
                break
    return kept, bg


def _background_token(ids: Sequence[int], u: float) -> int:
    token = int(u * QWEN3_ORDINARY)
    while token in ids:
        token = (token + 1) % QWEN3_ORDINARY
    return token


def _logsumexp(xs: Sequence[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))

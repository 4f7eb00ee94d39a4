"""The simulated servers' next-token distribution (loom.engine.fakes.next_token) against brute force over the
whole vocabulary: each distribution sums to one, truncation keeps what vLLM's min-p, top-k and top-p keep, and
every draw comes from what was kept."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.engine.fakes.next_token import BACKGROUND, CANDIDATES, SUPPORT, Sampling, _table, candidates, sample
from loom.engine.token_ids import QWEN3_ORDINARY

samplings = st.builds(
    Sampling,
    temperature=st.floats(0.05, 2.0),
    top_p=st.floats(0.05, 1.0),
    top_k=st.sampled_from([0, -1, 1, 5, 20, 64, 100]),
    min_p=st.sampled_from([0.0, 0.01, 0.1, 0.5]),
)


def _brute(prev: int, s: Sampling) -> np.ndarray:
    """The distribution drawn from, over every token: temperature, then min-p, top-k, top-p, renormalised."""
    logits = np.full(QWEN3_ORDINARY, BACKGROUND)
    ids, values, _ = candidates(prev)
    logits[list(ids)] = values
    p = np.exp(logits / s.temperature - np.logaddexp.reduce(logits / s.temperature))
    keep = np.ones_like(p, dtype=bool)
    if s.min_p > 0:
        keep &= p >= s.min_p * p.max()
    # The simulator ranks the background (equal logits, below every candidate) last and keeps or drops it whole:
    # a top-k past the candidates kept keeps it.
    ranked = sorted((t for t in ids if keep[t]), key=lambda t: -p[t])
    if s.top_k not in (0, -1) and s.top_k <= len(ranked):
        keep[:] = False
        keep[ranked[: s.top_k]] = True
    if s.top_p < 1:
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        acc = 0.0
        for j, t in enumerate(ranked):
            acc += q[t]
            if acc >= s.top_p:
                keep[:] = False
                keep[ranked[: j + 1]] = True
                break
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@settings(max_examples=60, deadline=None)
@given(prev=st.integers(0, QWEN3_ORDINARY - 1), s=samplings)
def test_the_processed_distribution_is_the_brute_force_one(prev: int, s: Sampling) -> None:
    table = _table(prev % SUPPORT, s)
    brute = _brute(prev, s)
    for t, lp in zip(table.ids, table.processed, strict=False):
        assert math.isclose(math.exp(lp), brute[t], rel_tol=1e-6)
    kept = sum(math.exp(lp) for lp in table.processed)
    if table.background is not None:
        kept += (QWEN3_ORDINARY - CANDIDATES) * math.exp(table.background[2])
    assert math.isclose(kept, 1.0, rel_tol=1e-9)
    # The distribution at the temperature, untruncated, is a distribution too.
    scaled = sum(math.exp(lp) for lp in table.scaled) + (QWEN3_ORDINARY - CANDIDATES) * math.exp(
        table.bg_scaled
    )
    assert math.isclose(scaled, 1.0, rel_tol=1e-9)


@settings(max_examples=30, deadline=None)
@given(prompt=st.lists(st.integers(0, QWEN3_ORDINARY - 1), min_size=1, max_size=8), s=samplings)
def test_every_draw_is_kept_and_repeats_under_its_seed(prompt: list[int], s: Sampling) -> None:
    steps = sample(prompt, 20, s, "seed")
    assert [x.token for x in steps] == [x.token for x in sample(prompt, 20, s, "seed")]
    for prev, step in zip([prompt[-1], *(x.token for x in steps)], steps, strict=False):
        assert _brute(prev, s)[step.token] > 0
        assert step.processed >= step.scaled - 1e-9  # truncation only moves mass onto what it keeps

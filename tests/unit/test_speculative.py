"""Suffix-match drafting and the acceptance replay: against brute force and their invariants."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.bench import acceptance
from loom.bench import speculative as bench
from loom.bench.acceptance import Case, Sample, Turn, replay
from loom.engine.clients.hf_spec import StepCost, paying_width
from loom.speculative.drafter import THRESHOLD, Draft, Drafter, SuffixIndex, draft_length, expected_kept

PROPS = settings(max_examples=150, deadline=None)
tokens = st.lists(st.integers(0, 3), max_size=12)


@PROPS
@given(
    ops=st.lists(st.tuples(st.integers(0, 3), tokens), max_size=12),
    tail=st.lists(st.integers(0, 3), min_size=0, max_size=6),
    lo=st.integers(1, 3),
    span=st.integers(0, 3),
)
def test_match_is_the_latest_longest_occurrence_with_a_continuation(
    ops: list[tuple[int, list[int]]], tail: list[int], lo: int, span: int
) -> None:
    idx = SuffixIndex(lo, lo + span)
    seqs: list[list[int]] = []
    stamp: list[list[int]] = []  # when each token arrived
    clock = 0
    for which, toks in ops:
        if which >= len(seqs):
            idx.add(toks)
            seqs.append([])
            stamp.append([])
            which = len(seqs) - 1
        else:
            idx.extend(which, toks)
        for t in toks:
            seqs[which].append(t)
            stamp[which].append(clock)
            clock += 1
    expected = None
    for n in range(min(lo + span, len(tail)), lo - 1, -1):
        hits = [
            (stamp[s][p], s, p)
            for s, seq in enumerate(seqs)
            for p in range(n, len(seq))
            if seq[p - n : p] == tail[len(tail) - n :]
        ]
        if hits:
            _, s, p = max(hits)
            expected = (n, s, p)
            break
    assert idx.match(tail) == expected


@given(p=st.floats(0.0, 1.0), k=st.integers(0, 12))
def test_expected_kept_is_the_sum_of_the_chances_of_each_prefix(p: float, k: int) -> None:
    assert expected_kept(p, k) == pytest.approx(sum(p**i for i in range(1, k + 1)), abs=1e-9)


@given(p=st.floats(0.0, 1.0), q=st.floats(0.0, 1.0))
def test_a_corpus_accepted_more_often_drafts_no_less(p: float, q: float) -> None:
    lo, hi = sorted((p, q))
    assert 0 <= draft_length(lo) <= draft_length(hi) <= 8
    # Each drafted token's chance of being reached and kept is at least the threshold; one more would not be.
    k = draft_length(p)
    assert k == 0 or p**k >= THRESHOLD - 1e-12
    assert k == 8 or p ** (k + 1) < THRESHOLD + 1e-12


def test_a_corpus_whose_drafts_fail_stops_drafting_then_tries_again() -> None:
    a = SuffixIndex()
    a.add([1, 2, 3] * 10)
    d = Drafter([("a", a)])
    for _ in range(30):
        draft = d.draft([1, 2])
        d.feedback(draft, 0)
    assert d.draft([1, 2]).tokens == []  # its estimate fell under the threshold
    while not d.draft([1, 2]).tokens:  # matched steps without a draft bring it back
        pass
    assert d.rate["a"] >= THRESHOLD


def test_the_longest_match_wins_and_a_fixed_drafter_drafts_its_length() -> None:
    a, b = SuffixIndex(), SuffixIndex()
    a.add([1, 2, 3, 9, 9])
    b.add([0, 1, 2, 3, 7, 7, 7])
    d = Drafter([("a", a), ("b", b)], fixed=2)
    assert d.draft([0, 1, 2, 3]).tokens == [7, 7]  # b matches 4 tokens, a only 3
    assert d.draft([5, 2, 3]).tokens == [9, 9]  # a tie: the corpus listed first
    assert d.draft([4, 4]).tokens == []


def test_feedback_moves_a_corpus_rate_toward_what_it_kept() -> None:
    a = SuffixIndex()
    a.add([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    d = Drafter([("a", a)])
    before = d.rate["a"]
    draft = d.draft([1, 2])
    d.feedback(draft, len(draft.tokens))
    assert d.rate["a"] > before
    draft = d.draft([1, 2])
    d.feedback(draft, 0)
    assert d.rate["a"] < before + 0.2


samples = st.lists(
    st.tuples(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.lists(st.integers(0, 4), max_size=8)),
    min_size=1,
    max_size=4,
)


def _sample(name: str, turns: list[tuple[list[int], list[int]]]) -> Sample:
    return Sample(name, "p", (1, 2), tuple(Turn(tuple(o), tuple(b)) for o, b in turns))


@PROPS
@given(
    me=samples,
    sib=samples,
    old=samples,
    use=st.lists(st.sampled_from(acceptance.SOURCES), min_size=1, max_size=4, unique=True),
    fixed=st.none() | st.integers(1, 8),
)
def test_every_token_is_made_once_and_a_step_makes_what_it_kept_and_one_more(
    me: list[tuple[list[int], list[int]]],
    sib: list[tuple[list[int], list[int]]],
    old: list[tuple[list[int], list[int]]],
    use: list[str],
    fixed: int | None,
) -> None:
    case = Case(_sample("me", me), (_sample("sib", sib),), (_sample("old", old),), (_sample("x", old),))
    t = replay(case, use, fixed)
    turns = len(me)
    assert t.tokens == sum(len(o) for o, _ in me)
    assert t.accepted <= t.drafted and t.drafting_steps <= t.steps
    # kept + 1 per step, except a turn's last step when its draft ran to the turn's end
    assert t.tokens <= t.steps + t.accepted <= t.tokens + turns
    assert sum(t.kept.values()) == t.steps


def test_an_earlier_epoch_that_said_the_same_is_drafted_almost_whole() -> None:
    said = [(list(range(10, 60)), [3, 3]), (list(range(60, 100)), [])]
    case = Case(_sample("me", said), (), (_sample("old", said),), ())
    alone = replay(case, ["own"], 8)
    with_history = replay(case, ["own", "history"], 8)
    assert alone.accepted == 0
    assert with_history.steps <= with_history.tokens / 4
    with pytest.raises(ValueError, match="unknown draft sources"):
        replay(case, ["own", "oracle"])


@PROPS
@given(
    rows=st.lists(st.tuples(st.integers(0, 8), st.floats(0.0, 1.0)), min_size=1, max_size=12),
    a=st.floats(0.0, 0.05),
    b=st.floats(1e-5, 0.01),
)
def test_a_verification_is_as_wide_as_pays_against_brute_force(
    rows: list[tuple[int, float]], a: float, b: float
) -> None:
    """The chosen width maximises the expected tokens' worth (at a plain step's seconds per token) less the
    padded columns' cost, against every width tried; unknown costs verify every drafted column."""
    drafts = [Draft(list(range(n)), "x", rate) for n, rate in rows]
    widest = max(n for n, _ in rows)
    per_token = (a + b * len(rows)) / len(rows)

    def net(w: int) -> float:
        kept = sum(rate**j for n, rate in rows for j in range(1, min(n, w) + 1))
        return kept * per_token - w * b * len(rows)

    best = max(net(w) for w in range(widest + 1))
    chosen = paying_width(drafts, (a, b))
    assert 0 <= chosen <= widest
    assert net(chosen) >= best - 1e-12 * max(1.0, abs(best))
    assert paying_width(drafts, None) == widest


def test_step_cost_is_fitted_once_steps_vary() -> None:
    cost = StepCost(window=16)
    for _ in range(10):
        cost.observe(32, 0.05)
    assert cost.fit() is None  # one size only: the slope is unknown
    for positions in range(1, 17):
        cost.observe(positions * 10, 0.002 + 0.0004 * positions * 10)
    a, b = cost.fit() or (0.0, 0.0)
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0004)
    assert len(cost._steps) == 16


def test_bench_reports_acceptance_per_source_with_intervals() -> None:
    r = bench.run(argparse.Namespace(quick=True, workloads="search"))
    s = r["accepted_per_step"]["search"]
    assert set(s) == {*acceptance.SOURCES, bench.ALL}
    for m in s.values():
        assert m["ci95"][0] <= m["mean"] <= m["ci95"][1]
    w = r["workloads"]["search"]
    assert set(w["fixed_lengths"]) == {"2", "4", "8"} and w["tokens_per_step_vs_own"] > 1
    # The search agent repeats its earlier trials nearly word for word: drafts from them are kept.
    assert s["history"]["mean"] > 2 * s["own"]["mean"]
    with pytest.raises(SystemExit, match="unknown workloads"):
        bench.run(argparse.Namespace(quick=True, workloads="chess"))

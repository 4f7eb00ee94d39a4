"""The model's estimate refined by a prompt's finished samples: bounds, limits and the online spreads."""

from __future__ import annotations

import itertools
import math
import random
from statistics import NormalDist

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loom.predict.blend import SiblingBlend, survived_median

lengths = st.floats(1.0, 1e6)


@given(lengths, st.lists(lengths, min_size=1, max_size=20))
def test_the_estimate_lies_between_the_model_and_the_siblings(model: float, done: list[float]) -> None:
    b = SiblingBlend(0.5)
    for x in done:
        b.observe("p", x)
    got = b.total("p", model, 0.0)
    mean = math.exp(sum(math.log(x) for x in done) / len(done))
    lo, hi = min(model, mean), max(model, mean)
    assert lo * (1 - 1e-9) <= got <= hi * (1 + 1e-9)


@given(st.floats(0.0, 15.0), st.floats(0.02, 2.0), st.floats(1.0, 1e7))
def test_survived_median_halves_the_survival_beyond_what_was_generated(
    centre: float, sd: float, gen: float
) -> None:
    """Against the definition: P(T > m) = P(T > g) / 2 for a log-normal T, wherever the exact form applies;
    always ahead of what was generated, and never behind the unconditioned median."""
    m = survived_median(centre, sd, gen)
    assert m > gen * (1 - 1e-12) and m >= math.exp(centre) * (1 - 1e-9)
    z = (math.log(gen) - centre) / sd
    if z < 5.0:
        std = NormalDist()
        assert std.cdf((centre - math.log(m)) / sd) == pytest.approx(std.cdf(-z) / 2, rel=1e-6, abs=1e-12)


@given(st.floats(5.0, 12.0), st.floats(0.05, 1.5), st.lists(st.floats(1.0, 1e6), min_size=2, max_size=2))
def test_survived_median_grows_with_what_was_generated(centre: float, sd: float, gens: list[float]) -> None:
    """The tail's asymptote joins the exact form: more generated never means a smaller total."""
    a, b = sorted(gens)
    assert survived_median(centre, sd, a) <= survived_median(centre, sd, b) * (1 + 1e-6)


def test_no_siblings_leaves_the_model_and_more_siblings_weigh_more() -> None:
    b = SiblingBlend(0.5)
    assert b.total("p", 1000.0, 0.0) == pytest.approx(1000.0)
    # Past the estimate the remainder does not vanish: the spread says how much is likely left.
    past = b.total("p", 1000.0, 5000.0)
    assert 5000.0 < past < 6000.0
    assert b.total("p", 1000.0, 100.0) == pytest.approx(1000.0, rel=0.01)
    pulls = []
    for _ in range(8):
        b.observe("p", 8000.0)
        pulls.append(b.total("p", 1000.0, 0.0))
    assert all(a < c for a, c in itertools.pairwise(pulls)) and pulls[-1] < 8000.0
    assert b.total("other", 1000.0, 0.0) == pytest.approx(1000.0)


def test_spreads_are_measured_online() -> None:
    rng = random.Random(0)
    b = SiblingBlend(model_log_sd=0.1, within_log_sd=0.1)
    for p in range(400):
        mu = rng.gauss(9.0, 0.6)
        for _ in range(4):
            x = math.exp(mu + rng.gauss(0.0, 0.5))
            b.observe(f"p{p}", x, admitted=math.exp(9.0))  # a model that knows only the overall scale
    spreads = b.spreads()
    assert spreads["within_log_sd"] == pytest.approx(0.5, abs=0.03)
    assert spreads["model_log_sd"] == pytest.approx(math.hypot(0.6, 0.5), abs=0.05)
    with pytest.raises(ValueError):
        SiblingBlend(0.0)

"""The model's estimate refined by a prompt's finished samples: bounds, limits and the online spreads."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loom.predict.blend import SiblingBlend

lengths = st.floats(1.0, 1e6)


@given(lengths, st.lists(lengths, min_size=1, max_size=20), st.floats(0.0, 1e6))
def test_the_estimate_lies_between_the_model_and_the_siblings(
    model: float, done: list[float], gen: float
) -> None:
    b = SiblingBlend(0.5)
    for x in done:
        b.observe("p", x)
    got = b.total("p", model, gen)
    mean = math.exp(sum(math.log(x) for x in done) / len(done))
    lo, hi = min(model, mean), max(model, mean)
    assert got >= gen and (lo * (1 - 1e-9) <= got <= hi * (1 + 1e-9) or got == gen)


def test_no_siblings_leaves_the_model_and_more_siblings_weigh_more() -> None:
    b = SiblingBlend(0.5)
    assert b.total("p", 1000.0, 0.0) == 1000.0
    assert b.total("p", 1000.0, 5000.0) == 5000.0  # never below what it has generated
    pulls = []
    for _ in range(8):
        b.observe("p", 8000.0)
        pulls.append(b.total("p", 1000.0, 0.0))
    assert all(a < c for a, c in itertools.pairwise(pulls)) and pulls[-1] < 8000.0
    assert b.total("other", 1000.0, 0.0) == 1000.0


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

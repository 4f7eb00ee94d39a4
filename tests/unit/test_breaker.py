"""The job's circuit breaker (services.scheduler.breaker) against its definition, on every order of finishes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.breaker import Breaker

finishes = st.lists(
    st.tuples(st.sampled_from(["completed", "failed", "aborted"]), st.sampled_from(["", "a", "b"])),
    max_size=20,
)


@given(finishes, st.integers(0, 10))
def test_it_trips_once_exactly_when_the_first_all_failed_with_one_cause(
    seq: list[tuple[str, str]], first: int
) -> None:
    b = Breaker(first)
    trips = [(i, c) for i, (status, cause) in enumerate(seq) if (c := b.see(status, cause)) is not None]
    head = seq[:first]
    expected = (
        first > 0
        and len(head) == first
        and all(s == "failed" and c for s, c in head)
        and len({c for _, c in head}) == 1
    )
    assert trips == ([(first - 1, head[0][1])] if expected else [])


def test_a_failure_that_says_nothing_of_its_cause_never_trips_it() -> None:
    b = Breaker(2)
    assert b.see("failed", "") is None and b.see("failed", "") is None

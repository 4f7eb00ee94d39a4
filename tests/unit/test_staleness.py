"""The asynchronous bound and a stream's refill rules (loom.policies.staleness)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from loom.policies.staleness import AsyncBound, groups_to_start, task_at


@given(st.integers(0, 6), st.integers(0, 50), st.integers(0, 50))
def test_admits_is_the_papers_rule(alpha: int, start: int, version: int) -> None:
    # RollArt §5.3: at version n every trajectory must have been started by a version no older than n - alpha.
    assert AsyncBound(alpha).admits(start, version) == (start >= version - alpha)


@given(st.integers(0, 6), st.integers(0, 50), st.integers(-1, 50))
def test_a_group_starts_only_if_the_trainer_could_still_take_it(
    alpha: int, version: int, consumed: int
) -> None:
    consumed = min(consumed, version)  # the trainer never took a batch at a version not reached yet
    bound = AsyncBound(alpha)
    ok = bound.may_start(version, consumed)
    # The trainer's next take: now if it has not taken at this version, else after the next update at least.
    earliest = version + 1 if consumed == version else version
    assert ok == bound.admits(version, earliest)
    if alpha == 0 and consumed == version:
        assert not ok  # synchronous: rollout waits while the batch trains
    if alpha >= 1:
        assert ok  # asynchronous: the next batch generates while this one trains


@given(st.integers(0, 100), st.integers(1, 100), st.one_of(st.none(), st.integers(0, 100)))
def test_back_pressure_never_exceeds_the_limit(open_groups: int, limit: int, remaining: int | None) -> None:
    n = groups_to_start(open_groups, limit, remaining)
    assert n >= 0 and open_groups + n <= max(limit, open_groups)
    if remaining is not None:
        assert n <= remaining


@given(st.integers(1, 40), st.integers(0, 3), st.integers(0, 10**6))
def test_every_epoch_visits_every_task_once(n: int, epoch: int, seed: int) -> None:
    for shuffle in (False, True):
        seen = sorted(task_at(epoch * n + i, n, shuffle, seed) for i in range(n))
        assert seen == list(range(n))
    assert [task_at(i, n, True, seed) for i in range(n)] == [task_at(i, n, True, seed) for i in range(n)]

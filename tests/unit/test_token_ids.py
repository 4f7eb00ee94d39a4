"""Synthetic token ids and the mapping between token ids and prefix keys (property tests)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loom.engine.token_ids import QWEN3_ORDINARY, QWEN3_VOCAB, ContextIds, ContextKeys, synth_ids

PROPS = settings(max_examples=150, deadline=None)
keys = st.text(min_size=1, max_size=80)
lengths = st.integers(0, 600)


@PROPS
@given(keys, lengths, lengths, lengths)
def test_every_window_is_a_slice_of_one_stream(key: str, start: int, n: int, m: int) -> None:
    whole = synth_ids(key, start + n + m)
    assert synth_ids(key, n, start=start) == whole[start : start + n]
    assert synth_ids(key, start + n) == whole[: start + n]  # the prefix property


@PROPS
@given(keys, keys, st.integers(8, 300))
def test_ids_are_deterministic_in_range_and_differ_by_key(key: str, other: str, n: int) -> None:
    ids = synth_ids(key, n)
    assert ids == synth_ids(key, n)
    assert all(0 <= t < QWEN3_ORDINARY < QWEN3_VOCAB for t in ids)
    if other != key:
        assert synth_ids(other, n) != ids
    assert all(0 <= t < 1000 for t in synth_ids(key, n, vocab=1000))


@PROPS
@given(keys, st.lists(st.tuples(lengths, lengths), min_size=1, max_size=6))
def test_a_trajectory_repeats_its_previous_context(key: str, steps: list[tuple[int, int]]) -> None:
    contexts = ContextIds(capacity=100_000)
    previous: list[int] = []
    for grow, generated in steps:
        ids = contexts.build(key, len(previous) + grow)
        assert ids[: len(previous)] == previous
        previous = ids + synth_ids("engine output", generated)
        contexts.remember(key, previous)


@PROPS
@given(st.lists(st.tuples(keys, st.integers(1, 400)), max_size=30), st.integers(0, 2000))
def test_remembered_contexts_stay_within_capacity(items: list[tuple[str, int]], capacity: int) -> None:
    contexts = ContextIds(capacity)
    for key, n in items:
        contexts.remember(key, synth_ids(key, n))
        assert len(contexts) <= capacity
    # A forgotten trajectory falls back to its key's stream: its first prompt still matches.
    for key, n in items:
        assert contexts.build(key, n)[:1] == synth_ids(key, 1)


@PROPS
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 300), st.integers(1, 100)), min_size=1, max_size=12)
)
def test_keys_follow_trajectories_through_their_contexts(steps: list[tuple[int, int, int]]) -> None:
    """Trajectories share a prompt and grow their contexts a step at a time (the engine's output, then a
    tool's); each keeps one key."""
    index = ContextKeys(capacity=10**6)
    prompt = synth_ids("prompt", 100)
    contexts: dict[int, list[int]] = {}
    named: dict[int, str] = {}
    for traj, grow, generated in steps:
        ids = contexts.get(traj, prompt) + synth_ids(f"tool {traj} {len(contexts.get(traj, []))}", grow)
        key = index.acquire(ids)
        if traj in named:
            assert key == named[traj]
        else:
            assert key not in named.values()  # a sibling with the same prompt is not another's trajectory
            named[traj] = key
        contexts[traj] = ids + synth_ids(f"output {traj} {len(ids)}", generated)
        index.release(key, contexts[traj])


def test_a_running_key_is_not_taken_and_capacity_evicts() -> None:
    index = ContextKeys(capacity=500)
    prompt = synth_ids("prompt", 200)
    first = index.acquire(prompt)
    sibling = index.acquire(prompt)  # the first request still runs: its context is not the sibling's
    assert sibling != first
    index.release(first, [*prompt, 1, 2])
    index.release(sibling, [*prompt, 3])
    step = [*prompt, 1, 2, 9]
    assert index.acquire(step) == first
    index.release(first, step)
    index.release(index.acquire(synth_ids("other", 300)), synth_ids("other", 300))
    assert index.acquire(step) not in (first, sibling)  # both least recently used, beyond the capacity

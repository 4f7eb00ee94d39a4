"""The simulated engine: event-driven core (property tests), prefix migration and real-time driver."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.clock import Clock
from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.model.perf import PerfModel
from loom.engine.sim.core import Speculation
from loom.engine.sim.engine import SimCore, SimEngine
from loom.engine.sim.prefix_cache import PrefixCache
from loom.weights import Incoming

PERF = PerfModel("h100", "qwen3-0.6b")
PERF_8B = PerfModel("h100", "qwen3-8b")
PROPS = settings(max_examples=120, deadline=None)


def check(core: SimCore) -> None:
    load = core.load()
    assert 0 <= load.kv_used_tokens <= load.kv_capacity_tokens
    assert 0 <= core.cache.evictable <= core.cache.tokens <= load.kv_used_tokens
    assert load.running <= core.max_running
    if core.host is not None:
        assert 0 <= core.host.tokens <= core.host_kv_tokens


def drain(core: SimCore) -> list[EngineOutput]:
    outs: list[EngineOutput] = []
    while (t := core.next_event_time()) is not None:
        before = core.now
        outs += core.advance(t)
        assert core.now >= before
        check(core)
    return outs


def assert_idle(core: SimCore) -> None:
    load = core.load()
    assert (load.running, load.waiting) == (0, 0)
    assert load.kv_used_tokens == core.cache.tokens == core.cache.evictable


def assert_every_request_exact(
    core: SimCore, outs: list[EngineOutput], max_new: list[int], aborted: set[str] | None = None
) -> None:
    """Every request ``r{i}`` came back once: an aborted one with at most ``max_new[i]`` tokens, every other
    with exactly them, no time negative; the engine's count agrees and it is left idle."""
    aborted = aborted or set()
    assert sorted(o.rid for o in outs) == sorted(f"r{i}" for i in range(len(max_new)))
    for o in outs:
        n = max_new[int(o.rid[1:])]
        if o.rid in aborted:
            assert o.finish_reason == "abort" and o.output_len <= n
        else:
            assert (o.finish_reason, o.output_len) == ("length", n)
        assert min(o.queue_s, o.prefill_s, o.decode_s) >= 0
    assert core.generated_tokens == sum(o.output_len for o in outs)
    assert_idle(core)


# Core: property tests

request = st.tuples(
    st.integers(1, 600),  # input_len
    st.integers(0, 300),  # max_new_tokens
    st.sampled_from([0.0, 1.0, 2.0]),  # priority
    st.one_of(st.none(), st.sampled_from("abcd")),  # prefix_key
    st.floats(0.0, 0.05),  # gap before arrival, seconds
    st.booleans(),  # abort it later
)
core_args = st.fixed_dictionaries(
    {
        "kv_capacity": st.integers(900, 3000),
        "max_running": st.integers(1, 12),
        "prefill_budget": st.sampled_from([64, 300, 8192]),
        "reserve_ratio": st.sampled_from([0.0, 0.1, 0.5]),
        "preempt_threshold": st.sampled_from([None, 0.0, 10.0]),
        "evict_by_priority": st.booleans(),
        "host_kv_tokens": st.sampled_from([0, 800, 6000]),
        "speculation": st.sampled_from(
            [None, Speculation(1.0, 1.0), Speculation(4.0, 2.5), Speculation(9.0, 5.0)]
        ),
    }
)


@given(workload=st.lists(request, min_size=1, max_size=40), args=core_args)
@PROPS
def test_kv_bounded_and_every_request_gets_exactly_its_tokens(workload: list, args: dict) -> None:
    core = SimCore(PERF, **args)
    outs: list[EngineOutput] = []
    aborted: set[str] = set()
    t = 0.0
    for i, (input_len, max_new, priority, key, gap, abort) in enumerate(workload):
        t += gap
        outs += core.advance(t)
        check(core)
        core.submit(EngineRequest(f"r{i}", input_len, max_new, prefix_key=key, priority=priority), t)
        if abort and i % 3 == 0:
            out = core.abort(f"r{i // 2}", t)
            if out is not None:
                outs.append(out)
                aborted.add(out.rid)
            check(core)
    outs += drain(core)
    assert_every_request_exact(core, outs, [r[1] for r in workload], aborted)


@given(workload=st.lists(request, min_size=1, max_size=40), args=core_args)
@PROPS
def test_weight_commits_keep_kv_bounded_and_every_request_exact(workload: list, args: dict) -> None:
    core = SimCore(PERF, **args)
    outs: list[EngineOutput] = []
    commits: list[float] = []
    t = 0.0
    for i, (input_len, max_new, priority, key, gap, commit) in enumerate(workload):
        t += gap
        outs += core.advance(t)
        core.submit(EngineRequest(f"r{i}", input_len, max_new, prefix_key=key, priority=priority), t)
        if commit:
            core.commit_weights(f"v{len(commits) + 1}", t)
            commits.append(t)
            check(core)
            assert core.cache.tokens == 0 and core.load().running == 0
            assert core.host is None or core.host.tokens == 0
    outs += drain(core)
    assert_every_request_exact(core, outs, [r[1] for r in workload])
    assert core.weight_version == (f"v{len(commits)}" if commits else "")


@given(workload=st.lists(request, min_size=1, max_size=30), args=core_args, at=st.floats(0.0, 2.0))
@PROPS
def test_abort_everything_frees_all_kv(workload: list, args: dict, at: float) -> None:
    core = SimCore(PERF, **args)
    finished: set[str] = set()
    t = 0.0
    for i, (input_len, max_new, priority, key, gap, _) in enumerate(workload):
        t += gap
        finished |= {o.rid for o in core.advance(t)}
        core.submit(EngineRequest(f"r{i}", input_len, max_new, prefix_key=key, priority=priority), t)
    finished |= {o.rid for o in core.advance(t + at)}
    aborted = {
        rid for i in range(len(workload)) if (rid := f"r{i}") not in finished and core.abort(rid, core.now)
    }
    assert finished | aborted == {f"r{i}" for i in range(len(workload))}
    assert_idle(core)
    assert core.next_event_time() is None


@given(
    steps=st.lists(
        st.tuples(st.integers(1, 3000), st.integers(0, 400), st.booleans()), min_size=1, max_size=20
    )
)
@PROPS
def test_prefix_hits_match_reference_for_one_trajectory(steps: list[tuple[int, int, bool]]) -> None:
    core = SimCore(PERF, 1_000_000)
    cached = 0  # reference: the key holds the last finished request's input + output
    for i, (fresh, max_new, grow) in enumerate(steps):
        # Usually the next step extends the context; sometimes it starts over shorter.
        input_len = cached + fresh if grow else fresh
        core.submit(EngineRequest(f"s{i}", input_len, max_new, prefix_key="traj"), core.now)
        (out,) = drain(core)
        assert out.cached_tokens == min(cached, input_len)
        cached = input_len + max_new
        assert core.cache.length("traj") == cached
    assert_idle(core)


@given(priorities=st.lists(st.sampled_from([-1.0, 0.0, 1.0, 5.0]), min_size=2, max_size=30))
@PROPS
def test_admission_follows_priority_then_fifo(priorities: list[float]) -> None:
    core = SimCore(PERF, 100_000, max_running=1, preempt_threshold=None)
    core.submit(EngineRequest("blocker", 10, 50), 0.0)
    core.advance(0.0)  # admits the blocker, so the rest queue behind it
    for i, priority in enumerate(priorities):
        core.submit(EngineRequest(f"r{i}", 10, 5, priority=priority), 0.0)
    order = [o.rid for o in drain(core)]
    expected = sorted(range(len(priorities)), key=lambda i: (-priorities[i], i))
    assert order == ["blocker"] + [f"r{i}" for i in expected]


@given(
    priorities=st.lists(st.sampled_from([-1.0, 0.0, 1.0, 5.0]), min_size=2, max_size=20),
    changes=st.lists(st.tuples(st.integers(0, 19), st.sampled_from([-2.0, 0.5, 3.0, 9.0])), max_size=10),
)
@PROPS
def test_reprioritized_waiting_requests_take_their_new_place(
    priorities: list[float], changes: list[tuple[int, float]]
) -> None:
    """The router re-keys a waiting request when its estimate moves: admission follows the new priorities
    (submission order among equals), and a running request is left as it is."""
    core = SimCore(PERF, 100_000, max_running=1, preempt_threshold=None)
    core.submit(EngineRequest("blocker", 10, 50), 0.0)
    core.advance(0.0)
    for i, priority in enumerate(priorities):
        core.submit(EngineRequest(f"r{i}", 10, 5, priority=priority), 0.0)
    core.advance(0.0)  # they have arrived and wait in the queue
    final = list(priorities)
    for i, priority in changes:
        if i < len(final):
            assert core.reprioritize(f"r{i}", priority)
            final[i] = priority
    assert not core.reprioritize("blocker", 100.0) and not core.reprioritize("nobody", 1.0)
    order = [o.rid for o in drain(core)]
    expected = sorted(range(len(final)), key=lambda i: (-final[i], i))
    assert order == ["blocker"] + [f"r{i}" for i in expected]


@given(
    ops=st.lists(
        st.one_of(
            request.map(lambda r: ("request", r)),
            st.tuples(st.sampled_from("abcd"), st.integers(0, 4000), st.floats(0.0, 0.05)).map(
                lambda i: ("import", i)
            ),
        ),
        min_size=1,
        max_size=40,
    ),
    args=core_args,
)
@PROPS
def test_imports_never_overfill_kv_nor_disturb_running_requests(ops: list, args: dict) -> None:
    core = SimCore(PERF, **args)
    outs: list[EngineOutput] = []
    wanted: dict[str, int] = {}
    t = 0.0
    for i, (kind, op) in enumerate(ops):
        if kind == "import":
            key, tokens, gap = op
            core.import_prefix(key, tokens, t, bandwidth_gbps=1.0)
        else:
            input_len, max_new, priority, key, gap, _ = op
            wanted[f"r{i}"] = max_new
            core.submit(EngineRequest(f"r{i}", input_len, max_new, prefix_key=key, priority=priority), t)
        t += gap
        outs += core.advance(t)
        check(core)
    outs += drain(core)
    assert {o.rid: o.output_len for o in outs} == wanted
    assert all(o.finish_reason == "length" for o in outs)
    assert_idle(core)


# Core: scenarios


@pytest.mark.parametrize(("low", "high", "retracted"), [(0.0, 1.0, "a"), (1.0, 1.0, "b")])
def test_retraction_takes_lowest_priority_then_newest(low: float, high: float, retracted: str) -> None:
    core = SimCore(PERF, kv_capacity=1000, reserve_ratio=0.0)
    core.submit(EngineRequest("a", 300, 600, prefix_key="a", priority=low), 0.0)
    core.submit(EngineRequest("b", 300, 600, prefix_key="b", priority=high), 0.0)
    outs = drain(core)
    assert core.retractions >= 1
    assert [o.rid for o in outs][-1] == retracted
    assert all((o.finish_reason, o.output_len) == ("length", 600) for o in outs)
    assert_idle(core)


def test_a_waiting_request_that_outranks_a_running_one_preempts_it() -> None:
    """Heddle Algorithm 1 on the engine (SGLang's priority preemption: threshold 10, strict)."""
    core = SimCore(PERF, 100_000, max_running=2)
    core.submit(EngineRequest("low", 100, 400, priority=1.0, prefix_key="low"), 0.0)
    core.submit(EngineRequest("mid", 100, 400, priority=50.0), 0.0)
    core.advance(0.01)
    core.submit(EngineRequest("near", 100, 10, priority=11.0), core.now)  # 11 > 1 + 10 fails: it waits
    core.submit(EngineRequest("urgent", 100, 10, priority=60.0), core.now)  # 60 > 1 + 10: evicts "low"
    outs = {o.rid: o for o in drain(core)}
    assert core.preemptions == 1
    assert {rid: o.output_len for rid, o in outs.items()} == {
        "low": 400,
        "mid": 400,
        "near": 10,
        "urgent": 10,
    }
    done_at = {rid: o.queue_s + o.prefill_s + o.decode_s for rid, o in outs.items()}
    assert done_at["urgent"] < done_at["low"]  # it did not wait for the low-priority request to finish


def test_priority_gap_must_exceed_the_threshold() -> None:
    core = SimCore(PERF, 100_000, max_running=1)
    core.submit(EngineRequest("a", 100, 200, priority=0.0), 0.0)
    core.advance(0.01)
    core.submit(EngineRequest("b", 100, 5, priority=10.0), core.now)  # 10 > 0 + 10 is false
    drain(core)
    assert core.preemptions == 0


def test_retracted_request_keeps_its_cached_prefix() -> None:
    core = SimCore(PERF, kv_capacity=2000, reserve_ratio=0.0)
    core.submit(EngineRequest("low", 500, 400, prefix_key="low", priority=0.0), 0.0)
    core.advance(0.05)
    core.submit(EngineRequest("high", 900, 500, priority=1.0), core.now)
    while core.retractions == 0:
        t = core.next_event_time()
        assert t is not None
        core.advance(t)
    assert (core.load().running, core.load().waiting) == (1, 1)
    assert core.cache.length("low") > 500 and core.cache.evictable == core.cache.length("low")
    outs = {o.rid: o for o in drain(core)}
    assert core.retractions == 1
    assert (outs["low"].output_len, outs["high"].output_len) == (400, 500)
    assert core.cache.length("low") == 900


def _next_step(commit: str | None, flush_cache: bool = True) -> tuple[SimCore, EngineOutput]:
    """A trajectory's second call, after its first and, with ``commit``, new weights between the two."""
    core = SimCore(PERF_8B, kv_capacity=50_000, host_kv_tokens=100_000)
    core.submit(EngineRequest("t.0", 3000, 500, prefix_key="t"), 0.0)
    drain(core)
    if commit is not None:
        core.commit_weights(commit, core.now, flush_cache)
    start = core.now
    core.submit(EngineRequest("t.1", 3600, 20, prefix_key="t"), start)
    (out,) = drain(core)
    assert core.now - start == pytest.approx(out.queue_s + out.prefill_s + out.decode_s)
    return core, out


def test_a_weight_commit_flushes_the_prefix_cache_and_its_host_tier() -> None:
    _, warm = _next_step(None)
    assert (warm.cached_tokens, warm.weight_version) == (3500, "")
    core, cold = _next_step("v2")
    assert (cold.cached_tokens, cold.weight_version) == (0, "v2")
    assert core.loaded_tokens == 0  # nothing came back from the host tier either
    assert cold.prefill_s > warm.prefill_s
    assert cold.prefill_s == pytest.approx(PERF_8B.iteration_time(3600, 0, 0))
    _, stale = _next_step("v2", flush_cache=False)  # SGLang told not to flush: the old KV stays in use
    assert (stale.cached_tokens, stale.weight_version, stale.prefill_s) == (3500, "v2", warm.prefill_s)


def test_sequences_running_at_a_weight_commit_recompute_their_context() -> None:
    def run(commit_at: float | None) -> tuple[EngineOutput, int]:
        core = SimCore(PERF_8B, kv_capacity=50_000)
        core.submit(EngineRequest("r", 2000, 400, prefix_key="r"), 0.0)
        generated = 0
        if commit_at is not None:
            core.advance(commit_at)
            generated = core.generated_tokens
            core.commit_weights("v2", commit_at)
            assert (core.load().running, core.load().waiting, core.kv_used_tokens) == (0, 1, 0)
        (out,) = drain(core)
        assert core.generated_tokens == out.output_len == 400
        return out, generated

    plain, _ = run(None)
    updated, generated = run(0.5)
    assert 0 < generated < 400 and updated.weight_version == "v2"
    recompute = PERF_8B.iteration_time(2000 + generated, 0, 0)
    assert updated.prefill_s == pytest.approx(plain.prefill_s + recompute)
    assert updated.cached_tokens == plain.cached_tokens == 0


def _evicted_then_resumed(host_kv_tokens: int) -> tuple[SimCore, EngineOutput, int]:
    """Trajectory ``a`` runs a step, ``b`` pushes part of its cache out of the device, ``a`` resumes; with
    what ``a`` kept on the device. An 8B model: for one as small as PERF's, recomputing a prefix is quicker
    than loading its KV over PCIe."""
    core = SimCore(PERF_8B, kv_capacity=3000, reserve_ratio=0.0, host_kv_tokens=host_kv_tokens)
    core.submit(EngineRequest("a0", 1800, 200, prefix_key="a"), 0.0)
    drain(core)
    core.submit(EngineRequest("b0", 2500, 100, prefix_key="b"), core.now)
    drain(core)
    kept = core.cache.length("a")
    core.submit(EngineRequest("a1", 2100, 50, prefix_key="a"), core.now)
    (out,) = drain(core)
    return core, out, kept


def test_host_tier_loads_an_evicted_prefix_back_instead_of_recomputing_it() -> None:
    core, out, kept = _evicted_then_resumed(host_kv_tokens=6000)
    assert kept == 3000 - 2600  # b took the rest
    assert out.cached_tokens == 2000 and core.loaded_tokens == 2000 - kept
    load_s = PERF_8B.kv_transfer_time(core.loaded_tokens, PERF_8B.gpu.host_link_gbps)
    assert out.prefill_s >= load_s * (1 - 1e-9)  # the load bounds the iteration that prefills a1
    bare, recomputed, _ = _evicted_then_resumed(host_kv_tokens=0)
    assert recomputed.cached_tokens == kept and bare.loaded_tokens == 0
    assert out.prefill_s < recomputed.prefill_s


def test_host_tier_keeps_the_higher_priority_prefixes_within_its_size() -> None:
    core = SimCore(PERF, kv_capacity=2000, reserve_ratio=0.0, evict_by_priority=True, host_kv_tokens=2500)
    for i, prio in enumerate([3.0, 1.0, 2.0]):
        core.submit(EngineRequest(f"r{i}", 1500, 100, prefix_key=f"p{prio:g}", priority=prio), core.now)
        drain(core)
    core.submit(EngineRequest("flush", 1900, 50, priority=9.0), core.now)
    drain(core)
    assert core.host is not None and core.host.tokens <= 2500
    assert core.host.length("p3") == 1600 and core.host.length("p1") < core.host.length("p2")


# A group's shared prompt (``EngineRequest.shared_prefix``)

shared_request = st.tuples(
    st.integers(1, 600),  # input_len
    st.integers(0, 300),  # max_new_tokens
    st.sampled_from([0.0, 1.0, 2.0]),  # priority
    st.sampled_from(["a", "b", "c", "d", "e", None]),  # prefix_key: a trajectory (None: a request of no key)
    # what its input starts with: a task set's system prompt, a group's prompt (levels, shortest first)
    st.lists(st.tuples(st.sampled_from("xyz"), st.integers(0, 700)), max_size=2).map(
        lambda levels: tuple(sorted(levels, key=lambda level: level[1]))
    ),
    st.floats(0.0, 0.05),  # gap before arrival, seconds
    # then: nothing, end the trajectory, abort an earlier request, or commit new weights
    st.sampled_from(["", "end", "abort", "commit"]),
)


@given(workload=st.lists(shared_request, min_size=1, max_size=40), args=core_args)
@PROPS
def test_shared_prompts_keep_kv_bounded_and_every_request_exact(workload: list, args: dict) -> None:
    core = SimCore(PERF, **args)
    outs: list[EngineOutput] = []
    aborted: set[str] = set()
    t = 0.0
    for i, (input_len, max_new, priority, key, shared, gap, then) in enumerate(workload):
        t += gap
        outs += core.advance(t)
        check(core)
        core.submit(
            EngineRequest(
                f"r{i}", input_len, max_new, prefix_key=key, priority=priority, shared_prefix=shared
            ),
            t,
        )
        if then == "end" and key is not None:
            core.end_prefix(key)
        elif then == "abort" and (out := core.abort(f"r{i // 2}", t)) is not None:
            outs.append(out)
            aborted.add(out.rid)
        elif then == "commit":
            core.commit_weights(f"v{i}", t)
        check(core)
    outs += drain(core)
    assert_every_request_exact(core, outs, [r[1] for r in workload], aborted)
    assert all(0 <= o.cached_tokens <= workload[int(o.rid[1:])][0] for o in outs)
    assert not core._live  # no request in the batch is left offering its context


def _prompt_then_sibling(shared: tuple[str, int] | None, sibling_group: str = "g") -> EngineOutput:
    """Sample 0 of a group runs its 3000-token prompt; then sample 1 of ``sibling_group`` arrives."""
    core = SimCore(PERF_8B, kv_capacity=50_000)
    core.submit(
        EngineRequest("a.0", 3000, 50, prefix_key="a", shared_prefix=(shared,) if shared else ()), 0.0
    )
    drain(core)
    other = ((sibling_group, shared[1]),) if shared else ()
    core.submit(EngineRequest("b.0", 3000, 50, prefix_key="b", shared_prefix=other), core.now)
    (out,) = drain(core)
    return out


def test_a_groups_prompt_is_prefilled_once_per_engine() -> None:
    alone = _prompt_then_sibling(None)
    shared = _prompt_then_sibling(("g", 3000))
    assert (alone.cached_tokens, shared.cached_tokens) == (0, 3000)
    assert shared.prefill_s == 0 < alone.prefill_s
    # Another group's prompt is not this one's.
    assert _prompt_then_sibling(("g", 3000), sibling_group="h").cached_tokens == 0
    # Only the tokens the group shares: the rest of the sibling's input is its own.
    part = _prompt_then_sibling(("g", 1000))
    assert part.cached_tokens == 1000 and 0 < part.prefill_s < alone.prefill_s


def test_another_groups_trajectory_shares_the_system_prompt_and_a_sibling_the_whole_prompt() -> None:
    core = SimCore(PERF_8B, kv_capacity=50_000)

    def run(rid: str, group: str) -> EngineOutput:
        levels = (("system", 1000), (group, 3000))
        core.submit(EngineRequest(rid, 3000, 10, prefix_key=rid, shared_prefix=levels), core.now)
        (out,) = drain(core)
        return out

    assert [run(*x).cached_tokens for x in (("a", "g"), ("b", "h"), ("c", "g"))] == [0, 1000, 3000]


def test_a_running_siblings_prefilled_prompt_is_shared_and_counted_in_kv_as_its_own() -> None:
    core = SimCore(PERF_8B, kv_capacity=50_000, reserve_ratio=0.0)
    core.submit(EngineRequest("a.0", 3000, 2000, prefix_key="a", shared_prefix=(("g", 3000),)), 0.0)
    while core.load().kv_used_tokens < 3001:  # a's prompt is prefilled and it decodes
        t = core.next_event_time()
        assert t is not None
        core.advance(t)
    core.submit(EngineRequest("b.0", 3000, 500, prefix_key="b", shared_prefix=(("g", 3000),)), core.now)
    core.advance(core.now + 0.05)
    # b's KV holds the prompt as a copy would (a radix tree would point at a's): the cache's size stays an
    # upper bound, and nothing is recomputed.
    assert core.load().running == 2 and core.load().kv_used_tokens >= 6000
    outs = {o.rid: o for o in drain(core)}
    assert outs["b.0"].cached_tokens == 3000 and outs["b.0"].prefill_s == 0


def test_a_sibling_shares_only_what_eviction_left_of_the_prompt() -> None:
    core = SimCore(PERF_8B, kv_capacity=4000, reserve_ratio=0.0)

    def run(rid: str, key: str, input_len: int, group: str | None = "g") -> EngineOutput:
        shared = () if group is None else ((group, 3000),)
        core.submit(EngineRequest(rid, input_len, 10, prefix_key=key, shared_prefix=shared), core.now)
        (out,) = drain(core)
        core.end_prefix(key)
        return out

    run("a.0", "a", 3000)
    run("x.0", "x", 3900, group=None)  # takes all but the head of a's context (a radix tree's leaf first)
    left = core.cache.length("a")
    assert 0 < left < 3000
    assert run("b.0", "b", 3000).cached_tokens == left
    run("y.0", "y", 3990, group=None)  # and now all of it
    assert core.cache.length("a") == core.cache.length("b") == 0
    out = run("c.0", "c", 3000)
    assert out.cached_tokens == 0 and out.prefill_s > 0


def test_chunked_prefill_spreads_a_long_prompt_over_iterations() -> None:
    core = SimCore(PERF, 100_000, prefill_budget=1000)
    core.submit(EngineRequest("long", 10_000, 1), 0.0)
    (out,) = drain(core)
    one = PERF.iteration_time(1000, 0, 0)
    assert out.prefill_s > 9 * one
    assert out.decode_s == 0


def test_lru_eviction_frees_least_recently_used_tail_first() -> None:
    cache = PrefixCache()
    for key, length in [("old", 100), ("new", 100)]:
        cache.acquire(key, key, 0)
        cache.release(key, key, length)
    cache.acquire("new", "reader", 60)
    assert cache.evict(150) == 140
    assert (cache.length("old"), cache.length("new"), len(cache)) == (0, 60, 1)
    assert (cache.tokens, cache.evictable) == (60, 0)


def test_priority_eviction_takes_the_lowest_priority_first_and_protects_the_higher() -> None:
    cache = PrefixCache(by_priority=True)
    for key, prio in [("long", 9.0), ("short", 1.0), ("mid", 5.0)]:
        cache.acquire(key, key, 0, prio)
        cache.release(key, key, 100)
    # A request of priority 5 may take the caches of priority 1 and 5, never the longer trajectory's.
    assert cache.evictable_below(1000, 5.0) == 200
    assert cache.evictable_below(1000, 5.0, spare="mid") == 100
    assert cache.evictable_below(50, 9.0) >= 50
    assert cache.evict(150) == 150
    assert (cache.length("short"), cache.length("mid"), cache.length("long")) == (0, 50, 100)
    cache.demote("long")  # its trajectory ended: first in line now
    assert cache.evict(100) == 100 and cache.length("long") == 0 and cache.length("mid") == 50
    assert (cache.tokens, cache.evictable) == (50, 50)
    # Without priorities every entry is fair game.
    assert PrefixCache().evictable_below(10, 0.0) == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("arev"), st.integers(0, 5), st.integers(0, 400), st.floats(0, 3)),
        max_size=60,
    )
)
def test_prefix_cache_accounting_holds_under_any_sequence(ops: list[tuple[str, int, int, float]]) -> None:
    cache = PrefixCache(by_priority=True)
    held: dict[str, str] = {}
    for n, (op, k, tokens, prio) in enumerate(ops):
        key = f"k{k}"
        if op == "a" and key not in held:
            rid = f"r{n}"
            cache.acquire(key, rid, min(tokens, cache.length(key)), prio)
            held[key] = rid
        elif op == "r" and key in held:
            cache.release(key, held.pop(key), tokens)
        elif op == "e":
            before = cache.tokens
            assert cache.evict(tokens) == before - cache.tokens
        elif op == "v":
            cache.demote(key)
        assert 0 <= cache.evictable <= cache.tokens
        assert cache.evictable_below(10**9, 10.0) == cache.evictable
        lengths = sum(cache.length(f"k{i}") for i in range(6))
        assert lengths == cache.tokens


def test_export_gives_the_cached_length_and_removes_or_keeps_it() -> None:
    core = SimCore(PERF, 100_000)
    core.submit(EngineRequest("a", 1000, 100, prefix_key="traj"), 0.0)
    drain(core)
    assert core.export_prefix("traj", remove=False) == 1100
    assert core.cache.length("traj") == core.kv_used_tokens == 1100
    assert core.export_prefix("traj") == 1100
    assert core.cache.length("traj") == core.kv_used_tokens == 0
    assert core.export_prefix("traj") == 0


def test_export_leaves_what_a_running_request_reuses() -> None:
    core = SimCore(PERF, 100_000)
    core.submit(EngineRequest("a", 1000, 100, prefix_key="traj"), 0.0)
    drain(core)
    core.submit(EngineRequest("b", 1500, 10_000, prefix_key="traj"), core.now)
    core.advance(core.now + 0.1)
    assert core.export_prefix("traj") == 1100
    assert core.cache.length("traj") == 1100 and core.cache.evictable == 0
    (out,) = drain(core)
    assert (out.cached_tokens, out.output_len) == (1100, 10_000)


@pytest.mark.parametrize(("early", "cached"), [(True, 0), (False, 5000)])
def test_imported_prefix_is_reused_once_it_has_landed(early: bool, cached: int) -> None:
    perf = PerfModel("h100", "qwen3-8b")
    core = SimCore(perf, 100_000)
    lands = core.import_prefix("traj", 5000, 1.0, bandwidth_gbps=25)
    assert lands == pytest.approx(1.0 + 5000 * perf.model.kv_bytes_per_token / 25e9)
    core.submit(EngineRequest("next", 6000, 10, prefix_key="traj"), lands - 1e-6 if early else lands)
    (out,) = drain(core)
    assert out.cached_tokens == cached
    assert core.cache.length("traj") == 6010


def test_import_takes_only_free_or_evictable_kv() -> None:
    core = SimCore(PERF, kv_capacity=3000, reserve_ratio=0.0)
    core.submit(EngineRequest("old", 400, 0, prefix_key="old"), 0.0)
    core.submit(EngineRequest("run", 2000, 500), 0.0)
    core.advance(0.01)
    assert core.cache.length("old") == 400
    core.import_prefix("new", 2500, core.now, bandwidth_gbps=1000)
    core.advance(core.now + 0.01)
    check(core)
    # "run" holds its context privately; the import evicted "old" and took the rest, not all it asked for.
    assert core.cache.length("old") == 0
    assert core.kv_used_tokens == 3000 and 0 < core.cache.length("new") < 2500
    (out,) = drain(core)
    assert (out.rid, out.output_len) == ("run", 500)


def test_simulates_over_a_million_tokens_per_second() -> None:
    perf = PerfModel("h100", "qwen3-8b")
    core = SimCore(perf, perf.kv_capacity_tokens())
    for i in range(2000):
        core.submit(
            EngineRequest(f"r{i}", 1000 + i % 3000, 200 + (i * 37) % 1500, prefix_key=f"k{i % 300}"), 0.0
        )
    start = time.perf_counter()
    outs = drain(core)
    elapsed = time.perf_counter() - start
    assert len(outs) == 2000
    assert core.generated_tokens / elapsed > 1e6


# Real-time driver


@pytest.fixture
async def engine():
    eng = SimEngine(model="qwen3-8b", gpu="h100", clock=Clock(speed=1000))
    await eng.start()
    yield eng
    await eng.close()


async def test_concurrent_generates_complete(engine: SimEngine) -> None:
    reqs = [EngineRequest(f"r{i}", 200 + 50 * i, 50 + 10 * i, prefix_key=f"k{i % 4}") for i in range(40)]
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert [(o.rid, o.output_len, o.finish_reason) for o in outs] == [
        (r.rid, r.max_new_tokens, "length") for r in reqs
    ]
    assert engine.info.kind == "sim"
    assert engine.load().running == 0


async def test_a_forced_reply_runs_as_a_generation_of_its_length(engine: SimEngine) -> None:
    """A scripted reply (``forced_ids``) costs what generating it would and comes back with its own ids and
    log-probs, the same for the same context and reply."""
    ctx, reply = [7, 8, 9], [100, 101, 102, 103]

    def forced(rid: str, n: int = 8, **kw: object) -> EngineRequest:
        return EngineRequest(
            rid, 3, n, input_ids=ctx, ignore_eos=True, return_logprob=True, forced_ids=reply, **kw
        )  # type: ignore[arg-type]

    a, b = await asyncio.gather(engine.generate(forced("a")), engine.generate(forced("b", top_logprobs=3)))
    assert a.output_ids == b.output_ids == reply and a.output_len == 4 and a.decode_s > 0
    assert a.output_logprobs == b.output_logprobs and len(a.output_logprobs or []) == 4
    assert b.output_top_logprobs is not None and all(
        t in [x for x, _ in row] for t, row in zip(reply, b.output_top_logprobs, strict=True)
    )
    cut = await engine.generate(forced("c", n=2))
    assert cut.output_ids == reply[:2] and len(cut.output_logprobs or []) == 2


async def test_cancelling_generate_aborts_the_request(engine: SimEngine) -> None:
    task = asyncio.create_task(engine.generate(EngineRequest("long", 1000, 200_000)))
    await asyncio.sleep(0.02)
    assert engine.load().running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_idle(engine.core)
    assert not await engine.abort("long")


async def test_abort_returns_abort_output(engine: SimEngine) -> None:
    task = asyncio.create_task(engine.generate(EngineRequest("x", 100, 200_000)))
    await asyncio.sleep(0.02)
    assert await engine.abort("x")
    out = await task
    assert out.finish_reason == "abort" and 0 < out.output_len < 200_000


async def test_pause_holds_progress(engine: SimEngine) -> None:
    task = asyncio.create_task(engine.generate(EngineRequest("p", 100, 20_000)))
    await asyncio.sleep(0.02)
    await engine.pause()
    held = engine.load().generated_tokens
    assert held > 0
    queued = asyncio.create_task(engine.generate(EngineRequest("q", 100, 10)))
    await asyncio.sleep(0.05)  # 50 simulated seconds
    assert engine.load().generated_tokens == held
    assert not task.done() and not queued.done()
    await engine.resume()
    out, short = await asyncio.gather(task, queued)
    assert (out.output_len, short.output_len) == (20_000, 10)
    assert out.decode_s > 50


async def test_prepare_commit_and_discard_weights(engine: SimEngine, tmp_path: Path) -> None:
    before = await engine.generate(EngineRequest("a", 10, 5))
    await engine.prepare_weights("v2", Incoming.disk(None))
    await engine.commit_weights("v2")
    after = await engine.generate(EngineRequest("b", 10, 5))
    assert (before.weight_version, after.weight_version, after.output_logprobs) == ("", "v2", None)
    await engine.prepare_weights("v3", Incoming.disk(str(tmp_path)))
    await engine.discard_weights("v3")
    with pytest.raises(RuntimeError, match="not prepared"):
        await engine.commit_weights("v3")
    assert engine.serving_path is None
    await engine.prepare_weights("v3", Incoming.disk(str(tmp_path)))
    await engine.commit_weights("v3")
    assert engine.serving_path == str(tmp_path)


async def test_preparing_a_missing_checkpoint_fails_and_keeps_the_version(
    engine: SimEngine, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        await engine.prepare_weights("v2", Incoming.disk(str(tmp_path / "missing")))
    with pytest.raises(RuntimeError, match="not prepared"):
        await engine.commit_weights("v2")
    assert (await engine.generate(EngineRequest("a", 10, 5))).weight_version == ""


async def test_a_request_running_across_a_weight_update_recomputes_its_context(engine: SimEngine) -> None:
    ref = await engine.generate(EngineRequest("ref", 1000, 10))  # the same prefill, alone, no update
    task = asyncio.create_task(engine.generate(EngineRequest("long", 1000, 100_000)))
    await asyncio.sleep(0.02)  # 20 simulated seconds: decoding, a long way from the end
    await engine.pause()
    generated = engine.load().generated_tokens - 10
    assert 0 < generated < 100_000
    await engine.prepare_weights("v2", Incoming.disk(None))
    await engine.commit_weights("v2")
    assert engine.core.cache.tokens == 0
    await engine.resume()
    out = await task
    assert (out.output_len, out.finish_reason, out.weight_version) == (100_000, "length", "v2")
    # Its prefill time counts its first prefill and the recomputation of its whole context at the update.
    recompute = engine.perf.iteration_time(1000 + generated, 0, 0)
    # The engine's clock is Unix-epoch based: a timestamp near 1.8e9 s is exact only to 2.4e-7 s, and each
    # phase is a difference of two, so the sum of phases is compared to a few of those steps, not to 1e-6.
    assert out.prefill_s == pytest.approx(ref.prefill_s + recompute, rel=0, abs=1e-6)


async def test_warm_prefix_caches_the_context(engine: SimEngine) -> None:
    await engine.warm_prefix("traj", 5000)
    out = await engine.generate(EngineRequest("next", 6000, 10, prefix_key="traj"))
    assert out.cached_tokens == 5000


async def test_prefix_migrates_between_engines() -> None:
    clock = Clock(speed=1000)
    src, dst = SimEngine(clock=clock), SimEngine(clock=clock)
    await src.start()
    await dst.start()
    try:
        await src.generate(EngineRequest("t0", 3000, 100, prefix_key="traj"))
        tokens = await src.export_prefix("traj")
        assert tokens == 3100 and src.core.cache.length("traj") == 0
        before = clock.now()
        await dst.import_prefix("traj", tokens)
        assert clock.now() - before >= dst.perf.kv_transfer_time(tokens)
        out = await dst.generate(EngineRequest("t1", 3500, 10, prefix_key="traj"))
        assert out.cached_tokens == 3100
    finally:
        await src.close()
        await dst.close()


async def test_close_aborts_in_flight_requests() -> None:
    eng = SimEngine(clock=Clock(speed=1000))
    await eng.start()
    task = asyncio.create_task(eng.generate(EngineRequest("z", 100, 300_000)))
    await asyncio.sleep(0.01)
    await eng.close()
    assert (await task).finish_reason == "abort"
    with pytest.raises(RuntimeError):
        await eng.generate(EngineRequest("late", 1, 1))


# Speculative decoding: each decode iteration is priced as a verification step over the tokens it keeps


def _alone(speculation: Speculation | None, n: int = 400, batch: int = 8) -> list[EngineOutput]:
    core = SimCore(PERF_8B, 200_000, speculation=speculation)
    for i in range(batch):
        core.submit(EngineRequest(f"r{i}", 1000, n), 0.0)
    return drain(core)


def test_one_position_keeping_one_token_is_plain_decoding() -> None:
    plain, same = _alone(None), _alone(Speculation(1.0, 1.0))
    assert [(o.rid, o.output_len, o.decode_s) for o in plain] == [
        (o.rid, o.output_len, o.decode_s) for o in same
    ]


def test_drafting_shortens_decoding_by_the_tokens_kept_over_the_steps_cost() -> None:
    plain = _alone(None)[0]
    spec = _alone(Speculation(5.0, 3.0))[0]
    # 399 decode iterations of 8 sequences after the prefill's token: a step at 5 positions keeps 3 tokens.
    step = PERF_8B.decode_span(8, 8 * 1001, 399, 5.0) / 3.0
    assert spec.decode_s == pytest.approx(step, rel=1e-6)
    assert spec.decode_s < plain.decode_s < 3.0 * spec.decode_s
    with pytest.raises(ValueError, match="tokens_per_step"):
        Speculation(2.0, 3.0)

from __future__ import annotations

import itertools
import statistics

import pytest

from loom.data.traces import Trace, TraceError, TraceStep, load_traces
from loom.envs.replay import ReplayEnv
from loom.predict.history import HistoryPredictor
from loom.protocol import Step, ToolLatency, Trajectory
from loom.rewards.context import RewardError
from loom.rewards.replay import replay_reward
from tests.conftest import need_shared


def _trace(n: int, tokens: int = 100, resolved: bool = True) -> Trace:
    steps = tuple(TraceStep(1000 * (k + 1), tokens, f"act{k}", f"obs{k}", 0) for k in range(n))
    return Trace("t1", resolved, "Submitted", steps)


def test_calls_follow_the_recording() -> None:
    env = ReplayEnv(_trace(5), ToolLatency(), seed=1, max_turns=100, max_tokens=10**6)
    calls = env.calls()
    assert [c.input_len for c in calls] == [1000, 2000, 3000, 4000, 5000]
    assert [c.last for c in calls] == [False] * 4 + [True]
    assert env.finish_reason(len(calls)) == "Submitted"


def test_calls_stop_at_max_turns_and_token_budget() -> None:
    env = ReplayEnv(_trace(10), ToolLatency(), seed=1, max_turns=3, max_tokens=10**6)
    assert len(env.calls()) == 3 and env.finish_reason(3) == "max_turns"
    env = ReplayEnv(_trace(10, tokens=100), ToolLatency(), seed=1, max_turns=100, max_tokens=250)
    calls = env.calls()
    assert [c.max_new_tokens for c in calls] == [100, 100, 50] and calls[-1].last
    assert env.finish_reason(3) == "max_tokens"


def test_tool_latency_has_the_configured_mean() -> None:
    env = ReplayEnv(_trace(1), ToolLatency(mean_s=0.43, sigma=0.8), seed=7, max_turns=1, max_tokens=1)
    xs = [env.sample_tool_latency() for _ in range(20000)]
    assert statistics.fmean(xs) == pytest.approx(0.43, rel=0.05)
    assert ReplayEnv(_trace(1), ToolLatency(mean_s=0.0), 1, 1, 1).sample_tool_latency() == 0.0


def test_real_traces_load() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    traces = load_traces()
    assert len(traces) == 400
    lengths = sorted(t.total_completion_tokens for t in traces.values())
    assert 8000 < lengths[200] < 11000  # data/README.md: median 9.6k completion tokens


def test_bad_trace_file_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1"):
        load_traces(bad)
    with pytest.raises(TraceError, match="not found"):
        load_traces(tmp_path / "missing.jsonl")


def test_replay_reward_is_the_recorded_outcome() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    traces = load_traces()
    resolved = next(t for t in traces.values() if t.resolved)
    unresolved = next(t for t in traces.values() if not t.resolved)
    for trace, want in ((resolved, 1.0), (unresolved, 0.0)):
        steps = [Step(k, 1, 1) for k in range(len(trace.steps))]
        traj = Trajectory(
            "j", "t", trace.id, 0, 0, "replay", "completed", "x", steps, 0, 1, info={"trace_id": trace.id}
        )
        assert replay_reward(traj) == want
    cut = Trajectory("j", "t", resolved.id, 0, 0, "replay", "completed", "max_turns", [Step(0, 1, 1)], 0, 1)
    cut.info["trace_id"] = resolved.id
    assert replay_reward(cut) == 0.0  # cut short: never submitted
    with pytest.raises(RewardError):
        replay_reward(Trajectory("j", "t", "x", 0, 0, "replay", "completed", "x", [], 0, 1))


def test_history_predictor_prefers_same_prompt_then_global() -> None:
    p = HistoryPredictor(prior_total=1000)
    assert p.predict_remaining("a", 0) == 1000
    p.observe("a", 4000)
    p.observe("b", 2000)
    assert p.predict_total("a", 0) == 4000
    assert p.predict_total("zzz", 0) == 3000
    assert p.predict_remaining("a", 1000) == 3000
    assert p.predict_total("a", 5000) == 10000  # outlived its estimate: heavy tail


def test_varied_samples_differ_but_each_is_reproducible() -> None:
    """A group's samples vary the recorded run (``loom.workloads.siblings``); the same seed gives the same
    sample, so a retried trajectory replays what it replayed before."""
    trace = _trace(12, tokens=300)
    runs = [ReplayEnv(trace, ToolLatency(), seed, 10**4, 10**7, "varied").calls() for seed in range(16)]
    totals = {sum(c.max_new_tokens for c in calls) for calls in runs}
    assert len(totals) > 8 and len({len(calls) for calls in runs}) > 2
    again = ReplayEnv(trace, ToolLatency(), 3, 10**4, 10**7, "varied").calls()
    assert again == runs[3]
    for calls in runs:
        # Each call replays a recorded one and the last is the recorded submission; context only grows.
        assert calls[-1].last and calls[-1].action == "act11"
        assert all(a.input_len < b.input_len for a, b in itertools.pairwise(calls))
        env = ReplayEnv(trace, ToolLatency(), 0, 10**4, 10**7, "varied")
        assert env.finish_reason(len(env.calls())) == "Submitted"
    with pytest.raises(ValueError, match="siblings"):
        ReplayEnv(trace, ToolLatency(), 0, 1, 1, "cloned")

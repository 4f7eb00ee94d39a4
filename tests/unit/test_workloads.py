"""Workloads built from the recorded traces: sizes, groups, token counts, the 40K output cap."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from loom.data.trace_sets import parse_runs
from loom.data.traces import TraceStep, load_traces
from loom.text.tokenizer import count_tokens, qwen_tokenizer
from loom.workloads import coding, search, tool_use
from loom.workloads.base import MAX_OUTPUT, WorkStep, cap_output
from loom.workloads.coding import TOOL_MEAN_S as CODING_TOOL_S
from loom.workloads.search import TOOL_MEAN_S as SEARCH_TOOL_S
from loom.workloads.siblings import SIGMA_CALLS, SIGMA_PER_CALL, vary, within_group_sigmas
from loom.workloads.tooluse import TOOL_MEAN_S as TOOL_USE_TOOL_S
from loom.workloads.tooluse import USER_BASE_S
from tests.conftest import need_shared


def test_qwen_tokenizer_matches_qwen_ids() -> None:
    need_shared("data/tokenizer/qwen.tiktoken")
    assert qwen_tokenizer().encode_ordinary("Hello world") == [9707, 1879]
    assert count_tokens("") == 0


def test_coding_groups_replay_one_run_with_their_own_tool_times() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    w = coding(prompts=3, group_size=4, seed=1, siblings="replay")
    assert w.groups == 3 and len(w.trajectories) == 12
    g = [t for t in w.trajectories if t.prompt == w.trajectories[0].prompt]
    assert len({t.output_tokens for t in g}) == 1  # the same recorded run
    assert len({t.steps[0].env_s for t in g}) == 4  # different tool draws
    assert coding(prompts=3, group_size=4, seed=1, siblings="replay").trajectories == w.trajectories
    full = coding(group_size=1, siblings="replay")
    assert statistics.median(t.output_tokens for t in full.trajectories) == 9613  # data/README.md: 9.6k
    assert max(t.output_tokens for t in full.trajectories) == MAX_OUTPUT


def test_coding_siblings_differ_as_multi_trial_traces_do() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    need_shared("data/traces/tau-bench-airline-gpt4o.json.gz")
    tau = within_group_sigmas(tool_use())
    # The model's constants are what the multi-trial traces measure.
    assert tau == {"calls": SIGMA_CALLS, "per_call": SIGMA_PER_CALL, "total": pytest.approx(0.458)}
    w = coding()
    assert w == coding()  # deterministic
    got = within_group_sigmas(w)
    assert got["calls"] == pytest.approx(SIGMA_CALLS, abs=0.02)
    assert got["total"] == pytest.approx(tau["total"], abs=0.03)
    replayed = coding(siblings="replay")
    mean = statistics.fmean(t.output_tokens for t in w.trajectories)
    assert mean == pytest.approx(statistics.fmean(t.output_tokens for t in replayed.trajectories), rel=0.03)
    traces = load_traces()
    for t in w.trajectories[:64]:
        recorded = traces[t.trace].steps
        assert len(t.origin) == len(t.steps) and t.origin[-1] <= len(recorded) - 1
        assert all(a.input_len < b.input_len for a, b in itertools.pairwise(t.steps))
        assert t.steps[0].input_len == recorded[0].prompt_tokens


def test_a_sibling_keeps_the_final_call_and_grows_its_context_by_its_own_output() -> None:
    steps = [TraceStep(100 * (k + 1) + 10 * k, 10, f"a{k}", f"o{k}", 0) for k in range(10)]
    rng = random.Random(0)
    for _ in range(200):
        calls = vary(steps, rng)
        origin = [i for i, _, _ in calls]
        assert origin[-1] == 9 and (origin[0] == 0 or origin == [9])
        assert sorted(origin) == origin  # replays keep the run's order
        for (_, ctx, out), (_, nxt, _) in itertools.pairwise(calls):
            assert nxt == ctx + out + 100  # each recorded observation is 100 tokens


def test_search_groups_are_real_trials_of_one_question() -> None:
    need_shared("data/traces/hotpotqa-react-100q-5trials.txt.gz")
    w = search()
    assert w.groups == 100 and len(w.trajectories) == 500
    lengths: dict[str, set[int]] = {}
    for t in w.trajectories:
        lengths.setdefault(t.prompt, set()).add(t.output_tokens)
    assert sum(len(v) > 1 for v in lengths.values()) == 26  # the logged agent was nearly deterministic
    assert 0.2 < statistics.fmean(t.reward or 0.0 for t in w.trajectories) < 0.5  # the logs: ~34% correct
    assert all(a.input_len < b.input_len for t in w.trajectories for a, b in itertools.pairwise(t.steps))
    # GRPO's 16 samples replay the 5 trials in turn, each with its own tool times.
    big = search(prompts=2, group_size=16)
    assert len(big.trajectories) == 32
    first = [t for t in big.trajectories if t.prompt == big.trajectories[0].prompt]
    assert first[0].output_tokens == first[5].output_tokens
    assert [s.env_s for s in first[0].steps] != [s.env_s for s in first[5].steps]


def test_react_log_parsing() -> None:
    log = (
        "Question: Who?\nThought 1: search it\nAction 1: Search[X]\nObservation 1: X is a\nthing.\n"
        "Thought 2: done\nAction 2: Finish[X]\nObservation 2: Answer is CORRECT\nCorrect answer: X\n\n"
        "Question: Why?\nThought 1: hm\nAction 1: Finish[no]\nObservation 1: Answer is INCORRECT\n"
    )
    runs = parse_runs(log)
    assert [(q, len(s), ok) for q, s, ok in runs] == [("Who?", 2, True), ("Why?", 1, False)]
    assert runs[0][1][0] == ("Thought 1: search it\nAction 1: Search[X]", "X is a\nthing.")


def test_tool_use_groups_are_tau_bench_trials() -> None:
    need_shared("data/traces/tau-bench-airline-gpt4o.json.gz")
    w = tool_use()
    assert w.groups == 40 and len(w.trajectories) == 160
    assert len(tool_use(prompts=3, group_size=16).trajectories) == 48
    t = w.trajectories[0]
    assert t.steps[-1].env_s == 0.0 and all(s.env_s > 0 for s in t.steps[:-1])
    assert all(a.input_len < b.input_len for a, b in itertools.pairwise(t.steps))


def test_what_trajectories_start_with_alike_is_their_system_prompt_and_their_groups_prompt() -> None:
    """``shared_prefixes``: every tau-bench trajectory opens with the airline policy (the same system message
    for every task), and its trials each with their own first user message; a search question's trials and a
    coding run's replays start from one prompt."""
    need_shared("data/traces/tau-bench-airline-gpt4o.json.gz")
    w = tool_use(prompts=3, group_size=8)
    shared = w.shared_prefixes()
    system = {t.system for t in w.trajectories}
    assert system == {1269}  # the airline policy, with its role and separators
    assert {shared[t.id] for t in w.trajectories} == {(("system:tool_use", w.trajectories[0].system),)}
    need_shared("data/traces/hotpotqa-react-100q-5trials.txt.gz")
    w = search(prompts=3, group_size=4)
    shared = w.shared_prefixes()
    assert all(shared[t.id] == ((f"prompt:{t.prompt}", t.steps[0].input_len),) for t in w.trajectories)
    # A SWE run's token counts are its provider's: what of them is the system message is not known, and only
    # a group's prompt is shared.
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    w = coding(prompts=3, group_size=4)
    shared = w.shared_prefixes()
    assert all(shared[t.id] == ((f"prompt:{t.prompt}", t.steps[0].input_len),) for t in w.trajectories)


def test_output_cap_truncates_the_last_call() -> None:
    steps = [WorkStep(10, 30_000, 1.0, 0.4), WorkStep(20, 30_000, 1.0, 0.4), WorkStep(30, 5, 1.0)]
    capped = cap_output(steps)
    assert [s.output_len for s in capped] == [30_000, MAX_OUTPUT - 30_000] and capped[-1].env_s == 0.0
    # The kept call keeps its draw and the draw's mean; nothing follows the last, drawn or expected.
    assert [(s.env_s, s.expected_env_s) for s in capped] == [(1.0, 0.4), (0.0, 0.0)]


def test_a_tool_latency_is_a_draw_and_each_step_keeps_its_mean() -> None:
    """What an exact predictor may know of the environment (the oracle's tool time): a drawn latency at its
    mean, a time that follows from the step (the simulated user's reply to its text) as it is."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    for w, mean in ((search(prompts=40), SEARCH_TOOL_S), (coding(prompts=20), CODING_TOOL_S)):
        draws = [s.env_s for t in w.trajectories for s in t.steps[:-1]]
        assert all(s.expected_env_s == mean for t in w.trajectories for s in t.steps[:-1])
        assert statistics.mean(draws) == pytest.approx(mean, rel=0.1)  # the draws' mean is the one kept
        t = max(w.trajectories, key=lambda t: t.tool_s)
        assert t.expected_tool_s == pytest.approx(mean * (len(t.steps) - 1)) and t.tool_s > t.expected_tool_s
    w = tool_use()
    steps = [s for t in w.trajectories for s in t.steps[:-1]]
    user = [s for s in steps if s.env_s >= USER_BASE_S]
    assert user and all(s.expected_env_s == s.env_s for s in user)
    assert all(s.expected_env_s == TOOL_USE_TOOL_S for s in steps if s.env_s < USER_BASE_S)


def test_a_cluster_plans_each_call_at_its_workloads_mean_environment_time() -> None:
    """The tool seconds per call a benchmark's cluster plans with are the workload's own mean, as a
    rollout-trace file's are: coding's and search's latency means exactly, and for tool use the mix of the
    airline API's calls and the simulated user's replies (a hand-set 0.3 s stood there, the mean is 0.47)."""
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    from loom.bench.heddle_suite import workload_of

    for name, mean in (("coding", CODING_TOOL_S), ("search", SEARCH_TOOL_S)):
        w, tool_s = workload_of(name, 12, 0)
        assert tool_s == mean == w.mean_env_s()
    w, tool_s = workload_of("tool_use", None, 0)
    gaps = [s.expected_env_s for t in w.trajectories for s in t.steps[:-1]]
    user = [g for g in gaps if g >= USER_BASE_S]
    assert TOOL_USE_TOOL_S < tool_s < max(user) and tool_s == pytest.approx(statistics.mean(gaps), abs=1e-9)
    assert tool_s == pytest.approx(0.473, abs=0.001)
    # A batch of a few tasks plans at the whole task set's mean, not at its own (whose users reply faster).
    few, few_s = workload_of("tool_use", 6, 0)
    assert few_s == tool_s and few.mean_env_s() < tool_s - 0.05


def test_the_mix_interleaves_tagged_groups_of_every_task_within_32k() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    from loom.bench.workload_mix import mixed

    w = mixed(prompts=6, group_size=8)
    tasks = [t.task for t in w.trajectories]
    assert tasks[:24] == ["coding"] * 8 + ["search"] * 8 + ["tool_use"] * 8
    assert {k: tasks.count(k) for k in set(tasks)} == {"coding": 48, "search": 48, "tool_use": 48}
    assert w.groups == 18 and all(t.prompt.startswith(t.task + "/") for t in w.trajectories)
    assert all(s.input_len + s.output_len <= 32_768 for t in w.trajectories for s in t.steps)
    with pytest.raises(ValueError, match="unknown tasks"):
        mixed(tasks=("chess",))

"""The rollout-trace schema: a file round-trips, a malformed line is an error naming its line and field, the
built-in workloads written in it replay as they do built in, and a Loom job's results convert to it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.data import rollout_trace as rt
from loom.data.importers.turns import mask_turns
from loom.data.trace_sets import trace_set
from loom.protocol import Step
from loom.protocol import Trajectory as Result
from loom.workloads import WORKLOADS, recorded

_text = st.one_of(st.none(), st.text(max_size=20))
_turns = st.builds(
    rt.Turn,
    context_tokens=st.integers(0, 10**6),
    output_tokens=st.integers(0, 10**5),
    finish_reason=st.one_of(st.none(), st.sampled_from(["stop", "length", "abort"])),
    env_s=st.one_of(st.none(), st.floats(0, 1e4, allow_nan=False)),
    tool_s=st.one_of(st.none(), st.lists(st.floats(0, 100, allow_nan=False), max_size=3)),
    action=_text,
    observation=_text,
)


@settings(max_examples=60, deadline=None)
@given(
    group=st.text(min_size=1, max_size=12),
    sample=st.integers(0, 64),
    step=st.integers(0, 1000),
    turns=st.lists(_turns, min_size=1, max_size=5),
    reward=st.one_of(st.none(), st.floats(-10, 10, allow_nan=False)),
    prompt=_text,
)
def test_any_trajectory_round_trips(
    group: str, sample: int, step: int, turns: list[rt.Turn], reward: float | None, prompt: str | None
) -> None:
    t = rt.Trajectory(rt.SCHEMA, group, sample, turns, step=step, reward=reward, prompt=prompt)
    assert rt.parse_line(rt.dumps(t)) == t


def test_a_file_round_trips_gzipped_and_by_step(tmp_path: Path) -> None:
    ts = [
        rt.Trajectory(rt.SCHEMA, g, s, [rt.Turn(100 + s, 10 * (s + 1), env_s=0.5)], step=step)
        for step in (3, 1)
        for g in ("a", "b")
        for s in range(2)
    ]
    path = tmp_path / "r.jsonl.gz"
    assert rt.write(path, ts) == 8
    assert rt.read(path) == ts
    assert [(s, len(b)) for s, b in rt.by_step(ts)] == [(1, 4), (3, 4)]
    rec = recorded.load(path)
    assert sorted(rec.steps) == [1, 3] and rec.step() == (1, rec.steps[1])
    assert rec.steps[3].by_prompt()["b"][1].id == "3/b/1" and rec.turns_without_env_s == 0
    with pytest.raises(ValueError, match=r"no step 2; the file holds steps \[1, 3\]"):
        rec.step(2)


GOOD = {"schema": rt.SCHEMA, "group": "g", "sample": 0, "turns": [{"context_tokens": 5, "output_tokens": 3}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sample": -1}, r"Expected `int` >= 0 - at `\$.sample`"),
        (
            {"turns": [{"context_tokens": 5, "output_tokens": "3"}]},
            r"Expected `int`, got `str` - at `\$.turns\[0\].output_tokens`",
        ),
        ({"turns": [{"context_tokens": 5}]}, r"missing required field `output_tokens` - at `\$.turns\[0\]`"),
        ({"turns": []}, r"length >= 1 - at `\$.turns`"),
        (
            {"schema": "loom.rollout-trace/0"},
            r"schema 'loom.rollout-trace/0', this Loom reads .* - at `\$.schema`",
        ),
        (
            {"turns": [{"context_tokens": 5, "output_tokens": 3, "tokens": 1}]},
            r"unknown field `tokens` - at `\$.turns\[0\]`",
        ),
        (
            {"turns": [{"context_tokens": 5, "output_tokens": 3, "cached_tokens": 9}]},
            r"cached_tokens 9 exceed .* - at `\$.turns\[0\].cached_tokens`",
        ),
        (
            {"turns": [{"context_tokens": 5, "output_tokens": 3, "env_s": -1}]},
            r">= 0.0 - at `\$.turns\[0\].env_s`",
        ),
        (
            {"system_tokens": 6, "turns": [{"context_tokens": 5, "output_tokens": 3}]},
            r"system_tokens 6 exceed the first turn's context_tokens 5 - at `\$.system_tokens`",
        ),
    ],
)
def test_a_malformed_line_names_its_line_and_field(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps(GOOD)
    path.write_text(f"{good}\n\n{json.dumps({**GOOD, 'sample': 1})}\n{json.dumps({**GOOD, **change})}\n")
    with pytest.raises(rt.TraceFormatError, match=f"^{path}:4: .*{message}"):
        rt.read(path)


def test_what_is_not_a_trace_says_so(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(rt.TraceFormatError, match=f"^{path}:2: not JSON"):
        rt.read(path)
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(rt.TraceFormatError, match=r":2: trajectory '0/g/0' again \(first at line 1\)"):
        rt.read(path)
    path.write_text("\n")
    with pytest.raises(rt.TraceFormatError, match="no trajectories"):
        rt.read(path)


@pytest.mark.parametrize("name", ["coding", "search", "tool_use"])
def test_a_built_in_workload_written_in_the_schema_loads_as_it_was(name: str, tmp_path: Path) -> None:
    w = WORKLOADS[name](prompts=3, group_size=4, seed=1)
    traces = {t.id: t for t in trace_set(name)}
    path = tmp_path / f"{name}.jsonl.gz"
    rt.write(path, recorded.to_trace(w, 0, traces))
    rec = recorded.load(path)
    assert rec.has_text and list(rec.steps) == [0] and rec.turns_without_env_s == 0
    again = rec.steps[0]
    assert [(t.id, t.prompt, t.sample, t.steps, t.reward, t.system) for t in again.trajectories] == [
        (t.id, t.prompt, t.sample, t.steps, t.reward, t.system) for t in w.trajectories
    ]
    # What its engines share through the prefix cache with it (tau-bench's airline policy).
    assert again.shared_prefixes() == w.shared_prefixes()
    # A file records the times that ran, not the means they were drawn from: its oracle knows them all.
    assert all(t.expected_tool_s == t.tool_s for t in again.trajectories)
    # Each call's text is the recorded call it replays (a coding sibling drops or repeats some).
    with gzip.open(path) as f:
        first = json.loads(f.readline())
    t0 = w.trajectories[0]
    src = traces[t0.trace].steps[t0.origin[1] if t0.origin else 1]
    assert first["turns"][1]["action"] == src.action and first["prompt"] == traces[t0.trace].task


def test_a_jobs_results_become_a_trace() -> None:
    def result(task: str, group: int, sample: int, steps: list[Step], version: int | None = None) -> Result:
        return Result(
            "job-1",
            f"t{group}-{sample}",
            task,
            group,
            sample,
            "code",
            "completed",
            "done",
            steps,
            0.0,
            1.0,
            reward=1.0,
            start_version=version,
        )

    call = Step(
        0, 120, 30, action="ls", observation="a.py", tool_s=0.25, finish_reason="stop", cached_tokens=100
    )
    last = Step(1, 160, 12, action="done", tool_s=0.0, finish_reason="length")
    results = [
        result("fix-parser", 0, 0, [call, last], version=4),
        result("fix-parser", 0, 1, [call]),
        result("dup", 1, 0, [call]),
        result("dup", 2, 0, [call]),
        result("never-ran", 3, 0, []),
    ]
    out, skipped = recorded.from_results(results)
    assert skipped == 1 and [t.group for t in out] == ["fix-parser", "fix-parser", "dup#g1", "dup#g2"]
    t = out[0]
    assert (t.id, t.step, t.sample, t.reward, t.task) == ("t0-0", 4, 0, 1.0, "code")
    assert t.turns == [
        rt.Turn(
            120, 30, cached_tokens=100, finish_reason="stop", env_s=0.25, action="ls", observation="a.py"
        ),
        rt.Turn(160, 12, cached_tokens=0, finish_reason="length", env_s=0.0, action="done", observation=""),
    ]
    assert out[1].step == 0


def test_a_files_steps_replay_in_order_each_prompt_remembering_its_earlier_steps(tmp_path: Path) -> None:
    """`bench rollout --step all`: every step in order, each prompt's earlier totals its history (the history
    predictor's and the combiner's), the figures summed over the steps."""
    import argparse

    from loom.bench import rollout as bench

    ts = [
        rt.Trajectory(rt.SCHEMA, g, s, [rt.Turn(200, 100 * (1 + g_i) * (s + 1), env_s=0.2)] * 3, step=step)
        for step in (0, 1)
        for g_i, g in enumerate(("short", "long"))
        for s in range(2)
    ]
    path = tmp_path / "two.jsonl"
    rt.write(path, ts)
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--workload", str(path), "--step", "all", "--predictor", "history", "--gpus", "8"])
    args.quick = False
    out = bench.run(args)
    assert out["file"]["step"] == [0, 1] and out["trajectories"] == 8
    for r in out["policies"].values():
        assert [s["output_tokens"] for s in r["steps"]] == [2700, 2700]
        assert r["makespan_s"] == pytest.approx(sum(s["makespan_s"] for s in r["steps"]), abs=0.11)
        assert r["throughput_tok_s"] == pytest.approx(5400 / r["makespan_s"], rel=1e-2)
    # The predictor at step 1 knows what step 0 ran of each prompt.
    from loom.bench.harness.rollout import _Predictor

    step1 = recorded.load(path).steps[1]
    pred = _Predictor("history", None, "two")
    pred.remember({"long": [600.0, 1200.0]})
    long0 = next(t for t in step1.trajectories if t.prompt == "long")
    assert pred.known(long0, 0, 0).history == (600.0, 1200.0)
    assert pred.total(long0, 0, 0) == 900.0
    args.step = "x"
    with pytest.raises(SystemExit, match="--step 'x': a step number, or 'all'"):
        bench.run(args)


@given(st.integers(0, 50), st.lists(st.integers(0, 1), max_size=60))
def test_a_loss_mask_splits_into_the_calls_it_holds(prompt: int, mask: list[int]) -> None:
    """Against brute force: a call per maximal run of 1s, its context everything before it, its output the
    run; a call is followed by an observation where a 0 comes after it."""
    calls = mask_turns(prompt, mask)
    runs = [
        (i, j)
        for i in range(len(mask))
        for j in range(i + 1, len(mask) + 1)
        if all(mask[i:j]) and (i == 0 or not mask[i - 1]) and (j == len(mask) or not mask[j])
    ]
    if not runs:
        assert calls == [(prompt + len(mask), 0, False)]
        return
    assert calls == [(prompt + i, j - i, j < len(mask)) for i, j in runs]
    assert sum(o for _, o, _ in calls) == sum(mask)

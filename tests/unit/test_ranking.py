"""Kendall's tau-b within batches: against brute force, and the heuristics' information at each step."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loom.bench.predictor_ranking import (
    FIRST_EPOCH,
    heuristic_scores,
    known_at,
    ranking_report,
    within_batches,
)
from loom.predict.evaluate import kendall_tau_b
from loom.workloads.base import Workload, WorkStep, WorkTraj


def _brute_tau_b(x: list[float], y: list[float], groups: list[str] | None = None) -> float:
    concordant = discordant = tied_x = tied_y = pairs = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        if groups is not None and groups[i] == groups[j]:
            continue
        pairs += 1
        dx, dy = x[i] - x[j], y[i] - y[j]
        tied_x += dx == 0
        tied_y += dy == 0
        s = dx * dy
        concordant += s > 0
        discordant += s < 0
    denom = math.sqrt((pairs - tied_x) * (pairs - tied_y))
    return 0.0 if denom == 0 else (concordant - discordant) / denom


@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.sampled_from("abc")), max_size=30))
def test_tau_b_equals_brute_force_with_ties_and_over_pairs_of_different_groups(
    rows: list[tuple[int, int, str]],
) -> None:
    x, y, g = [float(a) for a, _, _ in rows], [float(b) for _, b, _ in rows], [c for _, _, c in rows]
    assert kendall_tau_b(x, y) == pytest.approx(_brute_tau_b(x, y), abs=1e-12)
    assert kendall_tau_b(x, y, g) == pytest.approx(_brute_tau_b(x, y, g), abs=1e-12)


def test_between_prompts_sets_aside_the_order_within_a_prompt_that_leaving_one_out_reverses() -> None:
    """A sample's history is the rest of its group here, so the mean of its history orders a prompt's
    samples backwards; between prompts it ranks as the prompts' means do, and the prompt bound ties within."""
    w = Workload("t", "")
    for p, level in (("a", 100), ("b", 400), ("c", 1600)):
        w.trajectories += [_traj(p, s, [level + 10 * s], 50) for s in range(4)]
    learned = {t.id: np.full(len(t.steps), 1.0) for t in w.trajectories}
    report = ranking_report(w, learned, {0: {t.id: 1.0 for t in w.trajectories}})["step0"]
    mean = report["previous_mean"]
    assert mean["between_prompts"] == 1.0 and mean["tau"] < 0.8  # 18 of 66 pairs within a prompt, reversed
    assert report["prompt_bound"] == {
        "tau": pytest.approx(0.853, abs=1e-3),
        "between_prompts": 1.0,
        "between_vs_best": 0.0,
    }
    assert report["served"]["between_prompts"] == 0.0 and report["served_vs_best"]["between_diff"] == -1.0


def _traj(prompt: str, sample: int, outs: list[int], prompt_len: int) -> WorkTraj:
    steps = tuple(WorkStep(prompt_len + 100 * k, o, 1.0) for k, o in enumerate(outs))
    return WorkTraj(f"{prompt}-{sample}", prompt, sample, steps)


def _workload() -> Workload:
    w = Workload("t", "")
    # Prompt a: one sample finishes after 1 call, the other runs 3; prompt b: both run 2 and 4.
    w.trajectories += [
        _traj("a", 0, [10], 50),
        _traj("a", 1, [40, 40, 40], 50),
        _traj("b", 0, [20, 20], 900),
        _traj("b", 1, [30, 30, 30, 30], 900),
    ]
    return w


def test_heuristics_know_only_what_a_rollout_would_know_by_each_step() -> None:
    w = _workload()
    learned = {t.id: np.full(len(t.steps), 100.0) for t in w.trajectories}
    known0 = known_at(w, 0, learned)
    at0 = heuristic_scores(known0)
    # Nothing has finished at admission: the first-sibling heuristic knows nothing (all tie at 0 generated).
    assert set(at0["first_sibling"].values()) == {0.0} and known0["a-1"].finished == ()
    assert at0["prompt_length"] == {"a-0": 50.0, "a-1": 50.0, "b-0": 900.0, "b-1": 900.0}
    # Each sample's previous epoch is another sample of its prompt; its history all the others.
    assert at0["previous_epoch"]["a-0"] == 120.0 and at0["previous_epoch"]["a-1"] == 10.0
    assert known0["a-0"].history == (120.0,) and known0["b-1"].running == ((0, 0.0),)
    known1 = known_at(w, 1, learned)
    at1 = heuristic_scores(known1)
    # After one call a-0 is done: a-1 learns its sibling's 10 but has generated 40 already.
    assert "a-0" not in at1["learned"] and at1["first_sibling"]["a-1"] == 40.0
    assert known1["a-1"].finished == (10.0,) and known1["a-1"].running == ()
    assert at1["first_sibling"]["b-1"] == 30.0  # b's samples are all still running
    assert known1["b-1"].running == ((1, 20.0),) and known1["b-1"].generated == 30.0


def test_a_perfect_score_ranks_every_batch_perfectly_and_reports_steps_reached() -> None:
    w = _workload()
    exact = {t.id: np.full(len(t.steps), float(t.output_tokens)) for t in w.trajectories}
    taus = within_batches(w, heuristic_scores(known_at(w, 0, exact)), batch_prompts=2)
    assert taus["learned"].estimate == pytest.approx(1.0) and taus["learned"].batches == 1
    served = {0: {t.id: float(t.output_tokens) for t in w.trajectories}}
    report = ranking_report(w, exact, served)
    assert set(report) == {"step0", "step1", "step2"}  # nothing reaches step 5
    assert report["step0"]["learned"]["tau"] == 1.0 and report["step0"]["learned"]["trajectories"] == 4
    # The served scores are set beside the best free heuristic (the text model is not free), batch by batch.
    vs = report["step0"]["served_vs_best"]
    assert vs["best"] != "learned" and vs["diff"] > 0


def test_a_first_epoch_report_knows_no_earlier_sample_and_holds_served_to_what_is_left() -> None:
    """In a first epoch no heuristic reads the prompt's earlier samples: a served score that ranks only as
    well as the prompt's length is level with the best heuristic left."""
    w = _workload()
    exact = {t.id: np.full(len(t.steps), float(t.output_tokens)) for t in w.trajectories}
    by_prompt = {t.id: float(t.steps[0].input_len) for t in w.trajectories}
    report = ranking_report(w, exact, {0: by_prompt}, drop=FIRST_EPOCH)
    assert set(report["step0"]) == {
        "served",
        "learned",
        "first_sibling",
        "prompt_length",
        "served_vs_best",
        "in_sample_bound",
        "prompt_bound",
    }
    vs = report["step0"]["served_vs_best"]
    assert vs["best"] == "prompt_length" and vs["diff"] == 0.0
    assert {"previous_epoch", "previous_mean"} <= set(ranking_report(w, exact, {0: by_prompt})["step0"])


def test_the_in_sample_bound_finds_what_the_features_tell_and_never_falls_below_a_heuristic() -> None:
    """Totals set by the prompt (its earlier samples tell it) and a factor of each sample's own (the text
    model tells it): neither alone ranks a batch, a regression on both does, fitted on the answers."""
    rng = np.random.default_rng(0)
    w = Workload("t", "")
    for p in range(16):
        level = float(rng.uniform(5, 9))
        for sample in range(3):
            w.trajectories.append(
                _traj(f"p{p:02d}", sample, [int(math.exp(level) * (1 + 0.3 * sample))], 100)
            )
    text = {t.id: np.full(len(t.steps), 1000.0 * (1 + 0.3 * t.sample)) for t in w.trajectories}
    report = ranking_report(w, text, {0: {t.id: 1.0 for t in w.trajectories}})["step0"]
    bound, best = report["in_sample_bound"], report["served_vs_best"]["best"]
    assert bound["by"] in ("combined", "blend", "whole") and bound["tau"] > 0.99 > report[best]["tau"] + 0.1
    assert bound["vs_best"] == pytest.approx(bound["tau"] - report[best]["tau"], abs=0.002)
    assert "in_sample_bound" not in ranking_report(w, text)["step0"]  # nothing served, nothing to bound

"""What `loom train` reports beyond its runs: time to a reward, the spread over seeds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from loom_cli.train import paired_gain_ci, spread, time_to


def test_time_to_a_reward_is_the_first_window_that_reaches_it() -> None:
    steps = [
        {"reward": r, "wall_s": 10.0 * (i + 1)} for i, r in enumerate([0.1, 0.2, 0.6, 0.6, 0.6, 0.6, 0.9])
    ]
    assert time_to(steps, 0.5, window=3) == 50.0  # steps 3-5: mean 0.6
    assert time_to(steps, 0.5, window=1) == 30.0
    assert time_to(steps, 0.95, window=1) is None


def test_spread_over_seeds_reports_mean_sd_and_how_many_gained() -> None:
    runs = [
        {"reward_first": 0.3, "reward_last": 0.4, "reward_gain": 0.1, "reward_gain_ci95": [0.05, 0.15]},
        {"reward_first": 0.3, "reward_last": 0.3, "reward_gain": 0.0, "reward_gain_ci95": [-0.05, 0.05]},
    ]
    s = spread(runs)
    assert s["seeds"] == 2 and s["reward_gain_mean"] == 0.05 and s["gain_intervals_above_0"] == 1
    assert abs(s["reward_gain_sd"] - 0.0707) < 1e-3 and s["runs"] == runs


def test_gain_interval_resamples_prompts_not_games() -> None:
    """Ten games of one prompt are one observation: the interval over prompts is wider than one that treats
    every game as independent, and the gain is the mean over prompts."""
    prompts = {f"t{i}": f"p{i // 10}" for i in range(40)}  # 4 prompts, 10 games each
    first = dict.fromkeys(prompts, 0.0)
    last = {k: 1.0 if prompts[k] in ("p0", "p1") else 0.0 for k in prompts}
    gain, lo, hi = paired_gain_ci(first, last, prompts)
    assert gain == 0.5
    _, lo_games, hi_games = paired_gain_ci(first, last)
    assert hi - lo > 1.5 * (hi_games - lo_games)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(-1, 1)), min_size=1, max_size=30))
def test_gain_is_the_mean_of_per_prompt_means_and_inside_its_interval(games: list[tuple[int, float]]) -> None:
    prompts = {f"t{i}": f"p{p}" for i, (p, _) in enumerate(games)}
    first = dict.fromkeys(prompts, 0.0)
    last = {f"t{i}": d for i, (_, d) in enumerate(games)}
    by_prompt: dict[str, list[float]] = {}
    for k, d in last.items():
        by_prompt.setdefault(prompts[k], []).append(d)
    expected = sum(sum(v) / len(v) for v in by_prompt.values()) / len(by_prompt)
    gain, lo, hi = paired_gain_ci(first, last, prompts, n=400)
    assert abs(gain - expected) < 1e-9
    assert (
        min(min(v) for v in by_prompt.values()) - 1e-9
        <= lo
        <= hi
        <= max(max(v) for v in by_prompt.values()) + 1e-9
    )

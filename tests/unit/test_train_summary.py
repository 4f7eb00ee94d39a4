"""What `loom train` reports beyond its runs: time to a reward, the spread over seeds."""

from __future__ import annotations

from loom_cli.train import spread, time_to


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

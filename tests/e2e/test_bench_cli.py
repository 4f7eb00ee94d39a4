"""`loom bench` commands run as a user runs them: subprocesses, one JSON object on the last line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from loom import checkpoints as policy
from tests.conftest import need_shared
from tests.e2e.conftest import LOOM


def _bench(*args: str, timeout: float = 120) -> dict[str, Any]:
    r = subprocess.run(
        [LOOM, "bench", *args, "--json"], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def test_bench_engine_reports_calibration_and_throughput() -> None:
    out = _bench("engine", "--model", "qwen3-8b", "--gpu", "h20", "--throughput", "--quick")
    assert 0.9 <= out["decode_tok_s"] / 81.7 <= 1.1
    assert all(abs(p["rel_error"]) < 0.15 for p in out["calibration"]["points"])
    assert out["sim_tokens_per_wall_s"] == out["throughput"]["sim_tokens_per_wall_s"] > 0


def test_bench_engine_real_serves_the_same_rollouts_with_and_without_drafts(tmp_path: Path) -> None:
    """The transformers engine on this CPU, plain and drafting, on loom train's math rollouts (a fresh tiny
    policy stands in for the warm-started one, which takes minutes to train). Drafting is lossless: greedy,
    both engines generate the same tokens, so the same counts, turns and answers."""
    need_shared("data/tokenizer/qwen.tiktoken")
    model = policy.save(policy.build_tiny(seed=3), tmp_path / "tiny")
    out = _bench("engine", "--real", "--speculative", "--quick", "--model-path", str(model), timeout=300)
    real = out["real"]
    assert real["model_path"] == str(model) and real["threads"] >= 1
    for shape, by_t in real["by_shape"].items():
        assert set(by_t) == {"1.0", "0.0"}, shape
        for temp, cell in by_t.items():
            plain, drafting = cell["plain"]["runs"][0], cell["drafting"]["runs"][0]
            assert plain["trajectories"] == drafting["trajectories"] == cell["trajectories"] > 0
            assert cell["speedup"] == round(drafting["tokens_per_s"] / plain["tokens_per_s"], 3) > 0
            assert (
                drafting["verified_rows"] >= drafting["drafting_rows"]
                and drafting["drafted"] >= drafting["accepted"]
            )
            assert 0 <= cell["drafting"]["acceptance_rate"] <= 1
            if temp == "0.0":
                same = ("output_tokens", "turns", "solved")
                assert {k: plain[k] for k in same} == {k: drafting[k] for k in same}, shape


def test_bench_placement_matches_the_dp_and_beats_baselines() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("placement", "--quick")
    for row in (out, out["m64"]):
        assert row["same_makespan_as_dp"] is True
        assert row["median_ms"] > 0 and row["makespan_ratio"]["round_robin"] >= 1.0


def test_bench_resources_is_near_exhaustive() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("resources", "--quick")
    assert sum(out["degrees"]) == out["gpus"] == 64
    assert out["gap_to_exhaustive"] <= 0.02
    assert out["speedup_vs_fixed_1"] >= 1.0 and out["speedup_vs_fixed_8"] >= 1.0


def test_bench_rollout_rejects_an_unknown_policy() -> None:
    r = subprocess.run(
        [LOOM, "bench", "rollout", "--quick", "--baselines", "magic"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode != 0 and "bad policy 'magic'" in r.stderr


def test_bench_rollout_compares_the_policy_with_every_baseline() -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    # The first to train the quick predictor (cached for the others): about a minute alone, more beside CI.
    out = _bench("rollout", "--quick", timeout=360)
    assert out["predictor"] == "learned" and out["siblings"] == "varied"
    for k in ("step0", "step2"):  # the learned model's quality, with intervals
        for m in ("recall", "pearson"):
            low, high = out["prediction"][k][m]["ci95"]
            assert low <= out["prediction"][k][m]["estimate"] <= high
    assert set(out["policies"]) == {"heddle", "verl", "verl_star", "slime"}
    assert set(out["throughput_ratio"]) == {"verl", "verl_star", "slime"}
    assert set(out["tail_share_ratio"]) == {"verl", "verl_star", "slime"} and out["tail_cut_vs_slime"] < 1
    for r in out["policies"].values():
        assert r["makespan_over_lb"] >= 1.0 and r["output_tokens"] == out["output_tokens"]
        assert r["lower_bound_s"] == max(r["lower_bound_terms"].values())
        assert len(r["utilisation"]["of_peak"]) == 20 and max(r["utilisation"]["of_peak"]) == 1.0
    for key in (
        "throughput_tok_s",
        "makespan_s",
        "lower_bound_s",
        "makespan_over_lb",
        "longest_traj_queueing_s",
        "wall_s",
    ):
        assert key in out


def test_heddle_suite_quick_runs_every_cell_and_writes_its_report(tmp_path: Path) -> None:
    for trace in (
        "swe-gemini3pro.jsonl.gz",
        "hotpotqa-react-100q-5trials.txt.gz",
        "tau-bench-airline-gpt4o.json.gz",
    ):
        need_shared(f"data/traces/{trace}")
    out = _bench("heddle-suite", "--quick", "--speculative", "--out", str(tmp_path))
    systems = {"heddle", "verl", "verl_star", "slime"}
    assert set(out["overall"]) == {"coding", "search", "tool_use"}
    for by_model in out["overall"].values():
        assert set(by_model) == {"qwen3-8b", "qwen3-14b", "qwen3-32b"}
        for cell in by_model.values():
            assert set(cell["systems"]) == systems and set(cell["speedup"]) == systems - {"heddle"}
            tokens = {r["output_tokens"] for r in cell["systems"].values()}
            assert len(tokens) == 1  # every system generated the whole workload
            for r in cell["systems"].values():
                assert r["throughput_tok_s"] > 0 and r["makespan_over_lb"] >= 1.0
            # The tail: each system's share of the makespan spent on its last 10% of trajectories.
            assert set(cell["tail_share"]) == systems and set(cell["tail_share_ratio"]) == systems - {
                "heddle"
            }
            assert all(0 <= x < 1 for x in cell["tail_share"].values()) and cell["tail_cut_vs_slime"] < 1
            assert cell["vs_best_baseline"] <= cell["ceiling_vs_best"] * 1.01  # LB bounds every schedule
    assert out["min_ratio_vs_best"] == min(
        c["vs_best_baseline"] for m in out["overall"].values() for c in m.values()
    )
    assert out["min_learned_share"] is None or out["min_learned_share"] <= max(
        v for v in out["learned_keeps_of_oracle_gain"].values() if v is not None
    )
    want = {
        "scheduling": {"fcfs", "rr", "autellix", "pps"},
        "placement": {"least_load", "cache_aware", "loom"},
        "resources": {"fixed_1", "fixed_8", "adaptive"},
        "prediction": {"none", "history", "oracle", "clairvoyant", "learned"},
    }
    for exp, variants in want.items():
        for runs in out[exp].values():
            assert set(runs) == variants and all(r["throughput_tok_s"] > 0 for r in runs.values())
    assert out["predictor"] == "learned" and set(out["learned_keeps_of_oracle_gain"]) == set(out["overall"])
    assert set(out["learned_keeps_of_clairvoyant_gain"]) == set(out["overall"])
    assert set(out["prediction_quality"]) == set(out["overall"])
    # Drafting engines: every overall cell again, the same tokens generated, at the workload's measured rates.
    for w, by_model in out["drafting"].items():
        rates = out["speculation"][w]
        assert rates["positions"] >= rates["tokens_per_step"] > 1.0
        for m, cell in by_model.items():
            plain = out["overall"][w][m]["systems"]
            assert cell["output_tokens"] == {s: r["output_tokens"] for s, r in plain.items()}
            assert out["speculative_gain"][w][m] == cell["gain"]["heddle"] > 0
            # Drafting shortens decodes only: no gain passes the plain makespan over prefills and tool time.
            assert 1.0 < cell["gain_ceiling"] == out["speculative_gain_ceiling"][w][m]
            assert cell["gain"]["heddle"] <= cell["gain_ceiling"] <= cell["gain_ceiling_any_drafting"]
            # Engines with their own corpora: every system at its placement's share of tokens beside a sibling.
            local = out["local_corpus"][w][m]
            assert set(local["gain"]) == set(cell["gain"]) and out["speculative_gain_local"][w][m] > 0
            assert all(0.0 <= v <= 1.0 for v in local["sibling_local_share"].values())
    assert min(out["speculative_gain"]["coding"].values()) > 1.0  # coding is decode-bound: drafting pays
    assert out["min_speculative_gain"] == min(
        g for by_m in out["speculative_gain"].values() for g in by_m.values()
    )
    for by_model in out["overall"].values():
        for cell in by_model.values():  # Loom on exact lengths beside Loom with its learned predictor
            assert cell["oracle"]["throughput_tok_s"] > 0 and set(cell["oracle"]["speedup"]) == set(
                cell["speedup"]
            )
    assert set(out["target"]["met"]) == {"vs_slime", "vs_best_baseline", "makespan_over_lb"}
    assert set(out["target"]["makespan_breakdown"]) == {"queueing_s", "base_s", "interference_s", "tool_s"}
    last = out["target"]["last_finisher"]
    assert 0 <= last["first_call_queueing_s"] <= last["queueing_s"] and last["ranked_above"] >= 0
    report = (tmp_path / "report.md").read_text()
    assert (
        "## Drafting engines" in report and report.count("| qwen3-14b |") == 3 * 3
    )  # overall, tail, drafting
    for png in (
        "overall_throughput",
        "ablations",
        "active_trajectories",
        "completion_cdf",
        "utilisation",
        "gantt",
    ):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000 and f"{png}.png" in report


def test_bench_envs_reports_every_sigma_and_redundancy() -> None:
    need_shared("data/traces/tau-bench-airline-gpt4o.json.gz")
    out = _bench("envs", "--quick")
    speedups = out["trajectory_vs_batch_speedup"]
    assert list(speedups) == [str(s) for s in range(1, 11)]
    assert all(x > 1.0 for x in speedups.values())
    assert speedups["10"] > speedups["1"]  # wider latency spread, costlier barriers
    assert out["redundant_speedup"] is None or out["redundant_speedup"] > 0


def test_bench_rollmux_reports_every_policy_the_optimum_and_latency(tmp_path: Path) -> None:
    need_shared("data/cluster/openb_pod_list_default.csv")
    out = _bench("rollmux", "--quick", "--out", str(tmp_path))
    policies = {"loom", "solo", "random", "most_idle"}
    for key in ("cost_per_hour", "peak_cost", "slo_attainment", "saving_vs_solo"):
        assert set(out[key]) == policies
    assert out["slo_attainment"]["loom"] == 1.0 and out["saving_vs_solo"]["loom"] > 1.0
    assert 1.0 <= out["cost_over_optimal"] <= out["optimal"]["max"]
    assert set(out["decision_ms"]) == {"100", "1000", "2000"}
    assert all(Path(p).stat().st_size > 0 for p in out["plots"])


def test_bench_predictor_reports_every_method_with_intervals(tmp_path: Path) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    # Trains two small models for 20 s and 7 s, then times the progressive one: about a minute.
    out = _bench("predictor", "--quick", "--out", str(tmp_path), timeout=300)
    assert set(out["methods"]) == {"progressive", "prompt_only", "history"}
    for steps in out["methods"].values():
        assert {"step0", "step1", "step2"} <= set(steps)
        for m in steps.values():
            for name in ("recall", "pearson"):
                low, high = m[f"{name}_ci95"]
                assert low <= high and -1.0 <= m[name] <= 1.0
    assert set(out["step2_against"]) == {"step0", "prompt_only", "history"}
    for row in out["step2_against"].values():
        assert 0.0 <= row["recall"]["p_better"] <= 1.0
    for batch in ("b1", "b32", "served_b1", "served_b32"):
        assert 0 < out["latency_ms"][batch]["p50"] <= out["latency_ms"][batch]["p99"]
    assert set(out["served_over_text_p99"]) == {"b1", "b32"}
    assert 0 <= out["served_text_share"] <= 1
    assert (tmp_path / "progressive" / "model.onnx").exists()
    # Kendall's tau-b within batches on every trace set, for what the predictor serves, its text model and
    # each free heuristic; recall and Pearson beside it, the served against the best free heuristic paired by
    # batch; again with the predictor trained on the other two trace sets alone; and in a first epoch, where
    # no heuristic reads the prompt's earlier samples.
    assert set(out["ranking"]) == {"coding", "search", "tool_use", "held_out", "first_epoch"}
    assert (
        set(out["ranking"]["held_out"])
        == set(out["ranking"]["first_epoch"])
        == {"coding", "search", "tool_use"}
    )
    every = {"served", "learned", "first_sibling", "previous_epoch", "previous_mean", "prompt_length"}
    for rows, methods in [
        *((v, every) for k, v in out["ranking"].items() if k not in ("held_out", "first_epoch")),
        *((v, every) for v in out["ranking"]["held_out"].values()),
        *((v, every - {"previous_epoch", "previous_mean"}) for v in out["ranking"]["first_epoch"].values()),
    ]:
        assert "step0" in rows
        for step in ("step0", "step1", "step2", "step5"):
            for name, m in rows.get(step, {}).items():
                if name == "served_vs_best":
                    assert (
                        m["best"] in methods - {"served", "learned"}
                        and m["ci95"][0] <= m["diff"] <= m["ci95"][1]
                    )
                    continue
                if name == "prompt_bound":
                    # Every trajectory by its prompt's own mean: ties within a prompt, ranks between.
                    assert -1.0 <= m["tau"] <= 1.0 and -1.0 <= m.get("between_prompts", 0) <= 1.0
                    continue
                if name == "in_sample_bound":
                    # Its candidates include every heuristic the served model has: never below the best free one.
                    assert (
                        m["by"] in (methods - {"served"}) | {"combined", "blend", "whole"}
                        and m["vs_best"] >= 0
                    )
                    continue
                low, high = m["ci95"]
                assert -1.0 <= low <= m["tau"] <= high <= 1.0 and m["batches"] >= 1
                if "recall" in m:
                    assert 0.0 <= m["recall"] <= 1.0 and -1.0 <= m["pearson"] <= 1.0
        assert set(rows["step0"]) == methods | {"served_vs_best", "in_sample_bound", "prompt_bound"}


def test_bench_async_compares_the_modes_per_step(tmp_path: Path) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("async", "--quick", "--out", str(tmp_path))
    assert set(out["step_time_s"]) == {"sync", "one-off", "async-1", "async-2", "async-1-eager"}
    t = out["step_time_s"]
    assert t["async-1"] < t["one-off"] < t["sync"]
    # RollArt's order (the update at the take) lags the trainer one version more than pushing eagerly.
    lag = out["models"]["qwen3-8b"]["policy_lag_max"]
    assert lag["async-1"] == 2 and lag["async-1-eager"] == 1 and lag["one-off"] == 1 and lag["sync"] == 0
    assert out["speedup_vs_sync"] == round(t["sync"] / t["async-1"], 3)
    assert set(out["aborted_fraction"]) == {"1", "2"}
    for r in out["runs"]:
        assert r["step_time_s"] == pytest.approx(r["wait_s"] + r["train_s"] + r["sync_s"], rel=0.01)
    assert (tmp_path / "report.md").exists() and (tmp_path / "terms.png").exists()


def test_bench_affinity_compares_three_rollout_configurations(tmp_path: Path) -> None:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = _bench("affinity", "--quick", "--out", str(tmp_path))
    t = out["step_time_s"]
    assert set(t) == {"h800-only", "h20-only", "affinity"} and out["mode"] == "sync"
    assert out["vs_h20_only"] == round(t["h20-only"] / t["affinity"], 3) and out["vs_h20_only"] > 1.0
    v = out["models"]["qwen3-8b"]["async-1"]
    assert 0 < v["fixed_share"] <= 1 and set(v["step_time_s"]) == set(t)
    assert (tmp_path / "report.md").read_text().count("| qwen3-8b |") == 6 + 2
    # Loom's own mapping from the engine model, with its reasons.
    chosen = out["chosen_affinity"]["qwen3-8b"]
    assert chosen["affinity"]["coding"] == "h800" and chosen["why"][0].startswith(
        "coding sets the step's tail"
    )


def _export(workload: str, prompts: int, out: Path) -> None:
    """A built-in workload's first prompts as a rollout-trace file, through `loom trace export`."""
    r = subprocess.run(
        [LOOM, "trace", "export", workload, "--prompts", str(prompts), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr


def test_loom_plan_sweeps_the_cluster_and_matches_bench_rollout(tmp_path: Path) -> None:
    """`loom plan` on a rollout-trace file: the layout, every system at the size asked and around it, where the
    workload saturates, a plot; its figures at that size are `loom bench rollout`'s on the same cluster."""
    trace = tmp_path / "search.jsonl.gz"
    _export("search", 16, trace)
    common = ["--workload", str(trace), "--predictor", "history", "--gpus", "16"]
    r = subprocess.run(
        [LOOM, "plan", *common, "--out", str(tmp_path / "plots"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout.strip().splitlines()[-1])
    assert plan["sweep"]["gpus"] == [8, 16, 32] and set(plan["systems"]) == {
        "heddle",
        "verl",
        "verl_star",
        "slime",
    }
    assert sum(int(d) * n for d, n in plan["layout"]["degrees"].items()) <= 16
    assert (
        plan["saturation_gpus"]["measured"] in [*plan["sweep"]["gpus"], None] and plan["critical_path_s"] > 0
    )
    assert Path(plan["plot"]).stat().st_size > 10_000
    bench = _bench("rollout", *common)
    assert {s: f["makespan_s"] for s, f in plan["systems"].items()} == {
        s: f["makespan_s"] for s, f in bench["policies"].items()
    }


def test_a_files_text_is_read_by_the_learned_predictor_and_without_it_its_lengths(tmp_path: Path) -> None:
    """A built-in workload written out with its text is served as it is built in (the text model by the fold
    that never saw each prompt, the same combiners and trust): the same predictions and makespans. Without its
    text, what lengths allow, and the report says which."""
    need_shared("data/traces/tau-bench-airline-gpt4o.json.gz")
    trace = tmp_path / "tool.jsonl"
    _export("tool_use", 8, trace)
    common = ["rollout", "--quick", "--prompts", "8"]
    from_file = _bench(*common, "--workload", str(trace), timeout=360)
    built_in = _bench(*common, "--workload", "tool_use", timeout=360)
    assert from_file["predictor"] == "learned" and from_file["file"]["text"] is True
    assert from_file["prediction"] == built_in["prediction"]
    assert {s: p["makespan_s"] for s, p in from_file["policies"].items()} == {
        s: p["makespan_s"] for s, p in built_in["policies"].items()
    }
    bare = tmp_path / "bare.jsonl"
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    for row in rows:
        row.pop("prompt")
    bare.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lengths = _bench(*common, "--workload", str(bare), timeout=360)
    assert lengths["predictor"] == "learned (lengths only)" and lengths["file"]["text"] is False


def test_heddle_suite_runs_every_cell_on_a_rollout_trace_file(tmp_path: Path) -> None:
    """`--workload FILE`: every overall and ablation cell on the file's batch as recorded, each cell's share of
    its ceiling, the learned predictor on the file's text; a malformed file stops it naming the line."""
    trace = tmp_path / "tool.jsonl"
    _export("tool_use", 8, trace)
    out = _bench(
        "heddle-suite", "--quick", "--workload", str(trace), "--out", str(tmp_path / "suite"), timeout=300
    )
    # 3 models x (4 systems + Loom on exact lengths), and the ablations' variants that are not Loom itself.
    assert list(out["overall"]) == [str(trace)] and out["cells"] == 3 * 5 + 3 + 2 + 2 + 3
    for c in out["overall"][str(trace)].values():
        assert c["systems"]["heddle"]["trajectories"] == 32
        assert c["ceiling_share"] == pytest.approx(c["vs_best_baseline"] / c["ceiling_vs_best"], abs=2e-3)
    assert out["min_ceiling_share"] == min(c["ceiling_share"] for c in out["overall"][str(trace)].values())
    # The text model's quality on the file, as on a built-in workload.
    assert set(out["prediction_quality"]) == {str(trace)}
    assert set(out["prediction_quality"][str(trace)]) >= {"step0", "step2"}
    assert (tmp_path / "suite" / "report.md").exists()
    # --against an earlier run: the same cells again (the same seed and cached models: the same figures), against
    # a copy in which Loom's 14B cell was 5% faster: that cell, and only it, lost more than 1%.
    earlier = json.loads((tmp_path / "suite" / "results.json").read_text())
    loom = earlier["overall"][str(trace)]["qwen3-14b"]["systems"]["heddle"]
    loom["throughput_tok_s"] *= 1.05
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    again = _bench(
        "heddle-suite",
        "--quick",
        "--workload",
        str(trace),
        "--out",
        str(tmp_path / "again"),
        "--against",
        str(tmp_path / "earlier.json"),
        "--no-plots",
        timeout=300,
    )["against"]
    cell = f"overall/{trace}/qwen3-14b/heddle"
    assert again["compared"] == len(again["cells"]) == 3 * 4 + 4 + 3 + 3 + 5  # overall; the ablations
    assert again["losing"] == [{"cell": cell, "ratio": pytest.approx(1 / 1.05, abs=1e-4)}]
    assert all(r == 1.0 for c, r in again["cells"].items() if c != cell)
    assert again["headlines"]["min_ceiling_share"] == {
        "before": out["min_ceiling_share"],
        "now": out["min_ceiling_share"],
    }
    r = subprocess.run(  # another cluster's run: refused before the run, naming both sizes
        [
            LOOM,
            "bench",
            "heddle-suite",
            "--quick",
            "--gpus",
            "16",
            "--workload",
            str(trace),
            "--against",
            str(tmp_path / "earlier.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode != 0 and "a run on 8 GPUs" in r.stderr and "this one on 16" in r.stderr
    trace.write_text(trace.read_text().replace('"sample":', '"sample":"x",', 1).replace('"x",0', '"x"', 1))
    r = subprocess.run(
        [LOOM, "bench", "heddle-suite", "--quick", "--workload", str(trace)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode != 0 and f"{trace}:1: " in r.stderr and "$.sample" in r.stderr

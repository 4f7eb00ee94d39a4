"""GEM (gem-llm 0.1.0) through ``loom.envs.adapters.gem``, against the real package in its own virtualenv
(.venv-gem, which `make install` builds): what the scheduler computes without GEM, and what the GEM manager runs
with it (tests/unit/gem_scenarios.py, run by GEM's interpreter); the work lanes that keep GEM's trajectories on
GEM's managers; and Loom's wire structs under GEM's msgspec 0.19."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loom.envs import registry
from loom.envs.adapters import BadParams, LibraryMissing, UnknownName, gem
from loom.protocol import JobSpec, TaskSpec, subjects
from services.envmgr.settings import EnvmgrSettings
from services.scheduler.tasks import SpecError, resolve_tasks

ROOT = Path(__file__).parents[2]
GEM_PY = gem.default_python()
needs_gem = pytest.mark.skipif(
    GEM_PY is None or not Path(GEM_PY).exists(),
    reason="no GEM virtualenv (.venv-gem): `make install` builds it",
)
GUESS = "gem:game:GuessTheNumber-v0-easy"
MATH = "gem:math:GSM8K"


def _scenario(name: str, *args: str) -> Any:
    assert GEM_PY is not None
    cmd = [GEM_PY, "-W", "ignore", "-m", "tests.unit.gem_scenarios", name, *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.fixture
def fresh_catalog() -> Iterator[None]:
    gem.catalog.cache_clear()
    yield
    gem.catalog.cache_clear()


def test_gem_jobs_take_a_work_lane_of_their_own() -> None:
    assert registry.resolve(GUESS).lane == registry.resolve(MATH).lane == "gem"
    for env in ("math", "replay", "reasoning_gym:chain_sum", "skyrl_gym:gsm8k", "my_pkg.envs:Gem", "gemx:a"):
        assert registry.resolve(env).lane == subjects.MAIN_LANE
    assert registry.LANES == ("main", "gem")
    assert subjects.traj_work("job-1") == "loom.v1.trajwork.job-1"
    assert subjects.traj_work("job-1", "gem") == "loom.v1.trajwork.job-1.gem"
    # One token after trajwork for the main lane, two for a library's: the filters cannot overlap.
    assert subjects.traj_work_filter("main") == "loom.v1.trajwork.*"
    assert subjects.traj_work_filter("gem") == "loom.v1.trajwork.*.gem"
    assert subjects.traj_work_lanes("job-1") == "loom.v1.trajwork.job-1.>"
    assert EnvmgrSettings().lane_list() == ["main"]
    assert EnvmgrSettings(lanes=" gem, main,gem").lane_list() == ["gem", "main"]
    with pytest.raises(ValueError, match="lanes must name"):
        EnvmgrSettings(lanes="gem,skyrl")


def test_without_gems_interpreter_a_gem_job_is_refused_as_missing(
    monkeypatch: pytest.MonkeyPatch, fresh_catalog: None
) -> None:
    monkeypatch.setenv(gem.PYTHON_ENV, "")
    assert gem.default_python() is None
    with pytest.raises(LibraryMissing, match=r"make install. builds \.venv-gem"):
        gem.params("game:GuessTheNumber-v0-easy", {})
    spec = JobSpec(env=GUESS, tasks=[TaskSpec(id="0")], group_size=2)
    with pytest.raises(SpecError) as e:
        resolve_tasks(spec, None)
    assert e.value.loc == ["env"] and "gem-llm" in e.value.msg
    monkeypatch.setenv(gem.PYTHON_ENV, "/nowhere/bin/python")
    with pytest.raises(LibraryMissing, match="/nowhere/bin/python"):
        gem.catalog()


@needs_gem
def test_the_scheduler_reads_gems_registry_without_importing_gem() -> None:
    assert not gem.here()  # the main venv: GEM's registry comes from its interpreter
    cat = gem.catalog()
    assert cat["version"] == gem.VERSION
    assert cat["envs"]["game:GuessTheNumber-v0-easy"].endswith(":GuessTheNumberEnv")
    assert cat["envs"]["math:GSM8K"] == "gem.envs.math_env:MathEnv"
    assert "python_tool" in cat["python_tools"]
    # A game's tasks are seeds; GSM8K's are Loom's records, with GEM's default Python tool.
    assert registry.task_ids(GUESS, None, None, {"size": 5}) == ["0", "1", "2", "3", "4"]
    (t,) = registry.task_specs(GUESS, None, None, ["3"], {})
    assert t.data["params"] == {"kwargs": {}, "size": gem.DEFAULT_SIZE} and t.data["task_id"] == "3"
    (m,) = registry.task_specs(MATH, None, None, ["gsm8k-test/0"], {})
    assert m.data["params"] == {"kwargs": {}, "split": "test", "tool": "python_tool"}
    assert m.data["prompt"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert registry.reference_actions(MATH, m) == [
        "Let me compute it.\n<python>\nprint(9*2)\n</python>",
        "The answer is \\boxed{18}.",
    ]
    assert registry.reference_actions(GUESS, t)
    with pytest.raises(ValueError, match="no scripted policy"):
        registry.reference_actions(
            "gem:game:Sudoku-v0-easy",
            registry.task_specs("gem:game:Sudoku-v0-easy", None, None, ["0"], {})[0],
        )
    with pytest.raises(KeyError, match="seeds 0 to 4"):
        gem.task("game:GuessTheNumber-v0-easy", {"size": 5}, "5")


@needs_gem
def test_the_registry_is_read_from_the_venv_or_asked_of_its_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_catalog: None
) -> None:
    """The scheduler reads what `make install` kept beside the GEM venv while it describes the GEM installed
    there; without it (or stale) it asks the interpreter, which imports GEM in a child process."""
    assert GEM_PY is not None
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {GEM_PY} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv(gem.PYTHON_ENV, str(python))
    asked = gem.catalog()  # nothing kept here: asked of the interpreter
    assert "game:GuessTheNumber-v0-easy" in asked["envs"] and asked["version"] == gem.VERSION
    kept = {"version": gem.VERSION, "envs": {"game:Only-v0-easy": "gem.envs.game_env.only:OnlyEnv"}}
    (venv / gem.CATALOG).write_text(json.dumps({**kept, "python_tools": []}))
    dist = venv / "lib" / "python3.11" / "site-packages" / f"gem_llm-{gem.VERSION}.dist-info"
    dist.mkdir(parents=True)
    gem.catalog.cache_clear()
    assert gem.catalog()["envs"] == kept["envs"]
    dist.rename(dist.with_name("gem_llm-9.9.9.dist-info"))  # another GEM installed since: asked again
    gem.catalog.cache_clear()
    assert gem.catalog()["envs"] == asked["envs"]


@needs_gem
def test_what_gem_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(UnknownName, match="did you mean game:GuessTheNumber-v0-easy"):
        gem.params("game:GuessTheNumbr-v0-easy", {})
    with pytest.raises(UnknownName, match="Loom does not ship"):
        gem.params("math:Math12K", {})
    with pytest.raises(UnknownName, match="reasoning_gym:chain_sum"):
        gem.params("rg:chain_sum", {})
    for name, given, words in [
        ("game:GuessTheNumber-v0-easy", {"split": "test"}, "takes env_params"),
        ("game:GuessTheNumber-v0-easy", {"size": 0}, "size must be"),
        ("game:GuessTheNumber-v0-easy", {"kwargs": [1]}, "must be an object"),
        ("math:GSM8K", {"tool": "search_tool"}, "Python-tool wrappers"),
        ("math:GSM8K", {"split": "dev"}, "split must be"),
        ("math:GSM8K", {"kwargs": {"dataset_name": "x"}}, "leave them out"),
        ("math:GSM8K", {"kwargs": {"use_mp": False}}, "use_mp must stay true"),
    ]:
        with pytest.raises(BadParams, match=words):
            gem.params(name, given)
    # Through the scheduler's intake, each is a 422 naming its field.
    for env, params, loc in [
        ("gem:game:GuessTheNumbr-v0-easy", {}, ["env"]),
        (MATH, {"tool": "search_tool"}, ["env_params"]),
    ]:
        spec = JobSpec(env=env, env_params=params, tasks=[TaskSpec(id="0")])
        with pytest.raises(SpecError) as e:
            resolve_tasks(spec, None)
        assert e.value.loc == loc, e.value.msg
    scripted = JobSpec(env="gem:game:Mastermind-v0-easy", tasks=[TaskSpec(id="0")], scripted=True)
    with pytest.raises(SpecError) as e:
        resolve_tasks(scripted, None)
    assert e.value.loc == ["scripted"]


@needs_gem
def test_guess_the_number_plays_gems_game_and_a_binary_search_wins_it() -> None:
    out = _scenario("games")
    assert out["needs_sandbox"] is False
    for game in out["played"]:
        (first,) = game["first"]
        assert first["role"] == "user" and first["content"].startswith("You are playing Guess The Number.")
        assert "between 1 and 10 (inclusive) within 4 turns" in first["content"]
        steps = game["steps"]
        assert 1 <= len(steps) <= 4 and steps[-1]["done"] and not any(s["done"] for s in steps[:-1])
        # GEM's rewards: nothing for a hint, 1 for the number; the last guess is the secret.
        assert [s["reward"] for s in steps] == [0.0] * (len(steps) - 1) + [1.0]
        assert steps[-1]["reply"] == f"My guess is \\boxed{{{game['secret']}}}."
        for s in steps[:-1]:
            (obs,) = s["observation"]
            assert obs["role"] == "user" and "the target number is" in obs["content"]
            assert obs["content"].endswith(
                "\nEnter your next guess."
            )  # GEM's info suffix, as its wrappers add it
    # Seeds are tasks: the same seed is the same game, even reset concurrently in one process.
    secrets = {g["seed"]: g["secret"] for g in out["played"]}
    assert out["concurrent"] == [secrets["0"], secrets["1"]] * 8 and secrets["0"] != secrets["1"]
    assert len(set(secrets.values())) > 3
    # An unformatted reply: GEM's format-error reward, and the game ends.
    assert out["unformatted"]["reward"] == -0.1 and out["unformatted"]["done"] is True


@needs_gem
def test_gsm8k_runs_gems_math_env_with_its_python_tool_in_a_sandbox() -> None:
    out = _scenario("gsm8k")
    assert out["needs_sandbox"] is True
    answers = {"gsm8k-test/0": "18", "gsm8k-test/1": "3", "gsm8k-test/2": "70000", "gsm8k-test/3": "540"}
    for run in out["scripted"]:
        (first,) = run["first"]
        # GEM's question, then its tool wrapper's instruction.
        assert "Return your final answer within \\boxed{}." in first["content"]
        tool, answer = run["steps"]
        (obs,) = tool["observation"]
        assert obs == {"role": "tool", "content": f"Code execution result: {answers[run['task_id']]}\n\n"}
        assert tool["info"]["tool_type"] == "python_code" and not tool["done"]
        # GEM's python_tool rewards a tool call that ran (0.05 + 0.25); MathEnv grades the boxed answer.
        assert tool["reward"] == pytest.approx(0.3)
        assert answer["done"] and answer["reward"] == 1.0 and answer["info"]["correct"]
    # The sandbox's error and timeout come back as GEM words them; a wrong answer scores 0.
    assert "ZeroDivisionError" in out["error"]["observation"][0]["content"] and out["error"]["reward"] == 0.05
    assert (
        out["hang"]["observation"][0]["content"]
        == "Code execution result: Execution timed out after 5 seconds.\n"
    )
    assert out["wrong"]["done"] and out["wrong"]["reward"] == 0.0
    # Without the tool: the bare question, and the boxed answer alone.
    assert out["plain_first"][0]["content"].startswith("A robe takes 2 bolts")
    assert out["plain_script"] == "The answer is \\boxed{3}." and out["plain"]["reward"] == 1.0


@needs_gem
def test_loom_structs_encode_the_same_under_gems_msgspec() -> None:
    """GEM pins msgspec 0.19.0 (the main venv has a later one): the GEM manager's messages must be
    byte-identical, and each side must read the other's."""
    main = subprocess.run(
        [sys.executable, "-m", "tests.unit.gem_scenarios", "wire"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    ours = json.loads(main.stdout.splitlines()[-1])["encoded"]
    theirs = _scenario("wire", json.dumps(ours))
    assert theirs["encoded"] == ours and theirs["again"] == ours

"""One table resolves every environment name (loom.envs.registry.KINDS): built-in names, library prefixes and
import paths; a library is one entry and one adapter module (tests/unit/toy_library.py shows the least one)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from loom.envs import actions, registry
from loom.envs.registry import Builtin, ImportPath, Library, Special
from loom.protocol import JobSpec
from services.scheduler.tasks import SpecError, resolve_tasks


def test_every_kind_of_name_resolves_through_the_one_table() -> None:
    for name in ("code", "math", "search", "coin"):
        kind, arg = registry.resolve(name)
        assert isinstance(kind, Builtin) and kind.loop == "env" and arg == ""
    assert registry.resolve("replay") == (Special("replay"), "")
    assert registry.resolve("external") == (Special("external"), "")
    kind, arg = registry.resolve("reasoning_gym:chain_sum")
    assert isinstance(kind, Library) and kind.loop == "env" and arg == "chain_sum"
    # Any other prefix is an import path, as before: the user-environment loop imports it.
    for path in ("loom_guess:Guess", "tests.integration.user_envs:Echo", "reasoning.gym:Env"):
        assert registry.resolve(path) == (ImportPath(), path)
    for bad in ("nonsense", "reasoning_gym:", "module", ""):
        with pytest.raises(ValueError, match="environment"):
            registry.resolve(bad)
    # What the rest of Loom read before the table stays as it was.
    assert registry.DATASETS == {
        "code": ("humaneval", "mbpp"),
        "math": ("gsm8k", "gsm8k-train", "arith", "arith-eval"),
        "search": ("hotpotqa",),
        "coin": ("coin", "coin-eval"),
    }
    assert {n for n in registry.DATASETS if registry.resolve(n).sandboxed} == {
        "code",
        "math",
    } and registry.env_of_set("coin-eval") == "coin"
    assert [registry.resolve(e).sandboxed for e in ("code", "coin", "reasoning_gym:chain_sum")] == [1, 0, 0]
    assert [registry.resolve(e).lane for e in ("code", "gem:game:Sudoku-v0-easy", "a.b:C")] == [
        "main",
        "gem",
        "main",
    ]


def test_a_library_is_one_table_entry_and_one_adapter_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.KINDS, "toy:", Library("tests.unit.toy_library"))
    assert registry.resolve("toy:say").arg == "say"
    spec = msgspec.convert({"env": "toy:say", "dataset": {"offset": 1}, "scripted": True}, JobSpec)
    tasks = resolve_tasks(spec, None)
    assert [t.id for t in tasks] == ["1", "2"]
    assert tasks[0].data == {
        "set": "toy:say",
        "task_id": "1",
        "params": {"size": 3},
        "prompt": "say 1",
        "prompt_tokens": 3,
    }
    assert registry.task_of(tasks[0]) == {"question": "say 1", "answer": "1"}
    env = registry.make("toy:say", tasks[1], None, 1.0)
    script = registry.reference_actions("toy:say", tasks[1])

    async def episode() -> float:
        assert await env.reset() == "say 2"
        assert (await env.step(actions.parse(script[0]))).done
        return float(env.verdict()["score"])

    assert asyncio.run(episode()) == 1.0
    with_params = msgspec.convert({"env": "toy:say", "env_params": {"size": 5}, "dataset": {}}, JobSpec)
    assert len(resolve_tasks(with_params, None)) == 5
    cases = [
        ({"env": "toy:shout", "dataset": {}}, ["env"]),
        ({"env": "toy:say", "env_params": {"colour": 1}, "dataset": {}}, ["env_params"]),
        ({"env": "toy:say", "dataset": {"name": "gsm8k"}}, ["dataset", "name"]),
        ({"env": "toy:say", "dataset": {"path": "/x.jsonl"}}, ["dataset", "path"]),
        ({"env": "toy:say", "dataset": {"offset": 3}}, ["dataset", "offset"]),
        ({"env": "toy:say", "tasks": [{"id": "9"}]}, ["tasks", 0, "id"]),
    ]
    for body, loc in cases:
        with pytest.raises(SpecError) as e:
            resolve_tasks(msgspec.convert(body, JobSpec), None)
        assert e.value.loc == loc, (body, e.value)


def test_a_dataset_that_names_no_set_is_the_environments_own_tasks() -> None:
    coin = resolve_tasks(msgspec.convert({"env": "coin", "dataset": {"limit": 2}}, JobSpec), None)
    assert [t.data["set"] for t in coin] == ["coin", "coin"]
    assert coin == registry.task_specs("coin", "coin", None, registry.task_ids("coin", "coin", None)[:2])
    # A user environment's tasks are its own to name: inline, a jsonl file, or a built-in set by name.
    with pytest.raises(SpecError) as e:
        resolve_tasks(msgspec.convert({"env": "loom_guess:Guess", "dataset": {"limit": 2}}, JobSpec), None)
    assert e.value.loc == ["dataset", "name"]

"""The fleet's context limit per model, and the submission check that refuses a budget past it."""

from __future__ import annotations

import pytest

from loom.protocol import JobSpec, WorkerInfo
from loom.runtime.workers import context_limit
from services.scheduler.tasks import SpecError, check_context


def worker(wid: str, model: str, limit: int) -> WorkerInfo:
    return WorkerInfo(wid, model, "vllm", "h100", 1, 64, 500_000, 0.0, 0.0, max_context_tokens=limit)


FLEET = [
    worker("w0", "qwen3-8b", 40_960),
    worker("w1", "qwen3-8b", 32_768),
    worker("w2", "qwen3-8b", 0),  # says nothing (the simulator): bounds nothing
    worker("w3", "qwen3-32b", 8_192),
]


def test_the_limit_is_the_smallest_any_worker_of_the_model_says() -> None:
    assert context_limit(FLEET, "qwen3-8b") == 32_768
    assert context_limit(FLEET, "qwen3-32b") == 8_192
    assert context_limit(FLEET[2:3], "qwen3-8b") is None
    assert context_limit(FLEET, "other") is None


def test_a_budget_past_the_limit_is_refused_naming_its_field() -> None:
    check_context(JobSpec(model="qwen3-8b", max_tokens=32_768), FLEET)
    with pytest.raises(SpecError, match="max_tokens is 32769, past the 32768-token context") as e:
        check_context(JobSpec(model="qwen3-8b", max_tokens=32_769), FLEET)
    assert e.value.loc == ["max_tokens"]
    with pytest.raises(SpecError) as e:
        check_context(JobSpec(model="qwen3-32b", max_tokens=8_000, max_turn_tokens=9_000), FLEET)
    assert e.value.loc == ["max_turn_tokens"]
    check_context(JobSpec(model="qwen3-8b", max_tokens=1_000_000), [])  # no worker says yet

"""One table of engine kinds: the rollout worker's settings, its engine, `loom up` and the deployment all read
it, so a kind is named, checked and started the same way everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from loom.clock import Clock
from loom.engine import kinds
from loom.engine.clients.sglang import SGLangEngine
from loom.engine.clients.vllm import VLLMEngine
from loom.engine.sim.engine import SimEngine
from loom_cli import main
from loom_cli.deploy import DeployConfig, DeployError, Deployment
from services.rollout.settings import RolloutSettings


def test_each_kind_builds_its_engine_and_names_what_it_lacks() -> None:
    clock = Clock()
    assert isinstance(kinds.build(RolloutSettings(), clock, "sim"), SimEngine)
    s = RolloutSettings(sglang_url="http://127.0.0.1:1", vllm_url="http://127.0.0.1:2")
    assert isinstance(kinds.build(s, clock, "sglang"), SGLangEngine)
    assert isinstance(kinds.build(s, clock, "vllm"), VLLMEngine)
    for name, missing in (("sglang", "SGLANG_URL"), ("vllm", "VLLM_URL"), ("hf", "MODEL_PATH")):
        with pytest.raises(ValueError, match=missing):
            kinds.build(RolloutSettings(), clock, name)


def test_a_worker_of_an_unknown_kind_is_refused_with_the_kinds_there_are() -> None:
    with pytest.raises(ValidationError, match="unknown engine 'tgi': one of sim, hf, sglang, vllm"):
        RolloutSettings(engine="tgi")


def test_loom_up_offers_the_table_and_deploys_by_it(tmp_path: Path) -> None:
    parser = main.build_parser()
    assert parser.parse_args(["up", "--engine", "vllm"]).engine == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--engine", "tgi"])
    for name, k in kinds.KINDS.items():
        cfg = DeployConfig(home=tmp_path, engine=name, api_token="t" * 32, api_port=0)
        if k.serves_checkpoint:
            with pytest.raises(DeployError, match="checkpoint directory"):
                Deployment(cfg).check()
        elif k.url_setting is not None:
            with pytest.raises(DeployError, match="give their URLs"):
                Deployment(cfg).check()
    with pytest.raises(DeployError, match="unknown engine"):
        Deployment(DeployConfig(home=tmp_path, engine="tgi", api_token="t" * 32, api_port=0)).check()

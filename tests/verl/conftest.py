"""verl 0.9.1 itself (the verl extra, which `make install` installs), on the CPU: its config as its trainer
composes it, and a policy directory it can read (Loom's tiny Qwen3 and Qwen's tokenizer, no hub download)."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("verl") is None:
    collect_ignore_glob = ["test_*.py"]

# What importing verl says on a machine without its GPU engines, and Ray of its own API: not about Loom.
QUIET = [
    pytest.mark.filterwarnings("ignore::UserWarning:verl.*"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"),
]
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
PROMPT_LENGTH, RESPONSE_LENGTH = 96, 48


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The policy verl's config names (``actor_rollout_ref.model.path``): a tiny Qwen3's config and Qwen's
    tokenizer, which pads with <|endoftext|> as Loom does."""
    from loom import checkpoints as policy
    from loom.text.tokenizer import hf_tokenizer

    d = tmp_path_factory.mktemp("policy")
    config = policy.tiny_config(**SMALL)
    config.architectures = ["Qwen3ForCausalLM"]  # what a saved model's config says, and verl reads
    config.save_pretrained(d)
    hf_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def verl_config(policy_dir: Path) -> Callable[..., Any]:
    """``verl_config(*overrides)``: verl's ``ppo_trainer`` config, composed by Hydra as ``main_ppo`` composes it,
    with ``overrides`` in verl's command-line syntax on top of a small rollout on the tiny policy."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"

    def make(*overrides: str) -> Any:
        base = [
            f"actor_rollout_ref.model.path={policy_dir}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "algorithm.adv_estimator=grpo",
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with initialize_config_dir(config_dir=str(config_dir), version_base=None):
                return compose(config_name="ppo_trainer", overrides=[*base, *overrides])

    return make

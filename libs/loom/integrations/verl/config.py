"""The ``loom`` section of a verl config: which Loom to run verl's rollouts in, and how.

verl's own keys stay verl's (``actor_rollout_ref.rollout.prompt_length``, ``response_length``, ``temperature``,
``top_p``, ``val_kwargs``, ``trainer.default_local_dir``); this section adds what only Loom knows. It is a new
top-level key, so on verl's command line it goes in with Hydra's ``+``: ``+loom.url=http://... +loom.env=coin``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from loom.text.tokenizer import ENDOFTEXT


class LoomConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # The scheduler's REST edge (``loom up`` prints it).
    url: str
    # Any Loom environment (built-in, ``module:Class``, ...).
    env: str
    # The fleet verl trains (``loom up --model``); it must share the policy's tokenizer.
    model: str = "qwen3-tiny"
    # A sample's ``loom_task`` column, when text, is a task id of this built-in set.
    dataset: str | None = None
    # The admin's token. None: ``LOOM_API_TOKEN``, so that the secret stays out of the config verl logs.
    token: str | None = None
    max_turns: int = 4
    # Tokens a trajectory may generate; None: ``rollout.response_length``.
    max_tokens: int | None = None
    max_turn_tokens: int | None = None
    # Where verl saves checkpoints (``global_step_N/actor/huggingface``); None: ``trainer.default_local_dir``.
    checkpoints: str | None = None
    # More job fields, as ``POST /v1/jobs`` takes them (``reward``, ``policy``, ``env_params``, ...).
    job: dict[str, Any] = {}
    timeout_s: float = 1800.0
    # What pads prompts and responses (never attended to): Qwen's <|endoftext|>, verl's pad for Qwen.
    pad_token_id: int = ENDOFTEXT

    def api_token(self) -> str:
        token = self.token or os.environ.get("LOOM_API_TOKEN")
        if not token:
            raise ValueError("no Loom API token: set LOOM_API_TOKEN (or loom.token)")
        return token


def plain(value: Any) -> Any:
    """An OmegaConf node or a numpy value as plain Python (dicts, lists, scalars), as JSON takes it."""
    if hasattr(value, "_get_node"):  # an OmegaConf container
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return plain(value.tolist())
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def loom_config(verl_config: Any, **overrides: Any) -> LoomConfig:
    """The ``loom`` section of verl's config, with ``overrides`` (an agent loop's own keys) on top."""
    section = verl_config.get("loom") if verl_config is not None else None
    fields = {**(plain(section) or {}), **overrides}
    if "url" not in fields or "env" not in fields:
        raise ValueError(
            "verl's config needs a loom section with url and env (e.g. +loom.url=... +loom.env=...)"
        )
    return msgspec.convert(fields, LoomConfig)

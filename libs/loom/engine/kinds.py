"""The engine kinds a rollout worker can drive, in one table: the rollout service builds its engine from it, its
settings validate the name against it, and ``loom up`` and its deployment read from it which kinds drive a server
(and the setting that names it) and which serve a checkpoint. A new engine is one entry here.

The clients are imported when an engine is built, not with this table: the CLI reads it at start, and the
transformers engine would bring torch with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loom.clock import Clock
from loom.engine.base import Engine


class EngineSettings(Protocol):
    """What a kind reads of a rollout worker's settings (``services.rollout.settings.RolloutSettings``)."""

    @property
    def sglang_url(self) -> str | None: ...

    @property
    def vllm_url(self) -> str | None: ...

    @property
    def model_path(self) -> str | None: ...

    @property
    def weight_version(self) -> str: ...

    @property
    def threads(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def speculative(self) -> bool: ...

    @property
    def model(self) -> str: ...

    @property
    def gpu(self) -> str: ...

    @property
    def tp(self) -> int: ...

    @property
    def max_running(self) -> int: ...

    @property
    def hicache_ratio(self) -> float: ...

    @property
    def weight_link(self) -> str | None: ...


@dataclass(frozen=True)
class EngineKind:
    name: str
    help: str
    # The rollout setting that names the server a worker of this kind drives (None: it drives none).
    url_setting: str | None
    # It serves a checkpoint from disk (the rollout setting model_path, `loom up --model-path`).
    serves_checkpoint: bool
    build: Callable[[EngineSettings, Clock], Engine]


def _sglang(s: EngineSettings, clock: Clock) -> Engine:
    if not s.sglang_url:
        raise ValueError(
            "LOOM_ROLLOUT_ENGINE=sglang needs LOOM_ROLLOUT_SGLANG_URL, the SGLang server's base URL"
        )
    from loom.engine.clients.sglang import SGLangEngine

    # The server decides tp and max_running; the worker reports what it finds there.
    return SGLangEngine(s.sglang_url, model=s.model, gpu=s.gpu)


def _vllm(s: EngineSettings, clock: Clock) -> Engine:
    if not s.vllm_url:
        raise ValueError("LOOM_ROLLOUT_ENGINE=vllm needs LOOM_ROLLOUT_VLLM_URL, the vLLM server's base URL")
    from loom.engine.clients.vllm import VLLMEngine

    # As with SGLang, the server decides tp and max_running (max_num_seqs).
    return VLLMEngine(s.vllm_url, model=s.model, gpu=s.gpu)


def _hf(s: EngineSettings, clock: Clock) -> Engine:
    if not s.model_path:
        raise ValueError(
            "LOOM_ROLLOUT_ENGINE=hf needs LOOM_ROLLOUT_MODEL_PATH, the checkpoint directory to serve"
        )
    from loom.engine.clients.hf import HFEngine

    return HFEngine(
        s.model_path,
        model=s.model,
        weight_version=s.weight_version,
        max_running=s.max_running,
        threads=s.threads,
        seed=s.seed,
        speculative=s.speculative,
    )


def _sim(s: EngineSettings, clock: Clock) -> Engine:
    from loom.engine.sim.engine import SimEngine

    return SimEngine(
        model=s.model,
        gpu=s.gpu,
        tp=s.tp,
        clock=clock,
        max_running=s.max_running,
        hicache_ratio=s.hicache_ratio,
        weight_link=s.weight_link,
    )


KINDS: dict[str, EngineKind] = {
    k.name: k
    for k in (
        EngineKind("sim", "simulated engines (the performance model, in real time)", None, False, _sim),
        EngineKind("hf", "transformers on the CPU, serving a checkpoint (--model-path)", None, True, _hf),
        EngineKind("sglang", "SGLang servers (--engine-url)", "LOOM_ROLLOUT_SGLANG_URL", False, _sglang),
        EngineKind("vllm", "vLLM servers (--engine-url)", "LOOM_ROLLOUT_VLLM_URL", False, _vllm),
    )
}


def kind(name: str) -> EngineKind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(KINDS)}") from None


def build(s: EngineSettings, clock: Clock, name: str) -> Engine:
    """The engine of kind ``name`` that settings ``s`` describe (ValueError naming what is missing)."""
    return kind(name).build(s, clock)

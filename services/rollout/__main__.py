"""Rollout worker service: one per inference engine instance."""

from __future__ import annotations

from loom import service
from loom.engine.base import Engine
from loom.service import Runtime
from services.rollout.settings import RolloutSettings
from services.rollout.worker import RolloutWorker


def make_engine(rt: Runtime, s: RolloutSettings) -> Engine:
    if s.engine == "sglang":
        if not s.sglang_url:
            raise ValueError(
                "LOOM_ROLLOUT_ENGINE=sglang needs LOOM_ROLLOUT_SGLANG_URL, the SGLang server's base URL"
            )
        from loom.engine.sglang_client import SGLangEngine

        # The server decides tp and max_running; the worker reports what it finds there.
        return SGLangEngine(s.sglang_url, model=s.model, gpu=s.gpu)
    if s.engine == "vllm":
        if not s.vllm_url:
            raise ValueError(
                "LOOM_ROLLOUT_ENGINE=vllm needs LOOM_ROLLOUT_VLLM_URL, the vLLM server's base URL"
            )
        from loom.engine.vllm_client import VLLMEngine

        # As with SGLang, the server decides tp and max_running (max_num_seqs).
        return VLLMEngine(s.vllm_url, model=s.model, gpu=s.gpu)
    if s.engine == "hf":
        if not s.model_path:
            raise ValueError(
                "LOOM_ROLLOUT_ENGINE=hf needs LOOM_ROLLOUT_MODEL_PATH, the checkpoint directory to serve"
            )
        from loom.engine.hf import HFEngine

        return HFEngine(
            s.model_path,
            model=s.model,
            weight_version=s.weight_version,
            max_running=s.max_running,
            threads=s.threads,
            seed=s.seed,
            speculative=s.speculative,
        )
    from loom.engine.sim import SimEngine

    return SimEngine(
        model=s.model,
        gpu=s.gpu,
        tp=s.tp,
        clock=rt.clock,
        max_running=s.max_running,
        hicache_ratio=s.hicache_ratio,
        weight_link=s.weight_link,
    )


def build(rt: Runtime) -> RolloutWorker:
    s = rt.settings
    assert isinstance(s, RolloutSettings)
    return RolloutWorker(rt, s, make_engine(rt, s))


def main() -> None:
    service.main("rollout", RolloutSettings, build)


if __name__ == "__main__":
    main()

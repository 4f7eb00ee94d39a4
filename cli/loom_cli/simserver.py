"""``loom sim-server``: the simulated engine behind SGLang's or vLLM's HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import json

from loom import logs

# Each API's default port, as its own server picks it.
DEFAULT_PORTS = {"sglang": 30000, "vllm": 8000}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sim-server",
        help="serve the simulated engine over SGLang's or vLLM's HTTP API (LOOM_ROLLOUT_ENGINE=sglang|vllm)",
    )
    p.add_argument(
        "--api",
        choices=tuple(DEFAULT_PORTS),
        default="sglang",
        help="whose HTTP API to serve: SGLang's native one, or vLLM's OpenAI-compatible one with its dev routes",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, help="default: the API's own (SGLang 30000, vLLM 8000); 0 picks a free one"
    )
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--speed", type=float, default=1.0, help="simulated time runs this many times faster")
    vllm = p.add_argument_group("vLLM's flags (--api vllm)")
    vllm.add_argument(
        "--generation-config",
        help="a checkpoint's generation_config.json (or its directory), whose sampling fills every field a "
        "request leaves out, as vLLM's --generation-config auto does",
    )
    vllm.add_argument(
        "--logprobs-mode",
        choices=("processed_logprobs", "raw_logprobs"),
        default="processed_logprobs",
        help="which distribution reported log-probs come from; vLLM's own default is raw_logprobs, Loom needs "
        "processed_logprobs",
    )
    vllm.add_argument(
        "--max-model-len", type=int, help="the longest context served (default: the KV cache's)"
    )
    sglang = p.add_argument_group("SGLang's flags (--api sglang)")
    sglang.add_argument(
        "--preferred-sampling-params",
        help="JSON sampling parameters /generate takes for every field a request leaves out",
    )
    sglang.add_argument(
        "--context-length", type=int, help="the longest context served (default: the KV cache's)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logs.configure("sim-server", "INFO")
    port = DEFAULT_PORTS[args.api] if args.port is None else args.port
    if args.api == "vllm":
        from loom.engine.fakes import vllm_server

        if args.preferred_sampling_params or args.context_length:
            raise SystemExit(
                "--preferred-sampling-params and --context-length are SGLang's flags (--api sglang)"
            )
        options = vllm_server.Options(
            generation_defaults=vllm_server.generation_defaults(args.generation_config)
            if args.generation_config
            else {},
            logprobs_mode=args.logprobs_mode,
            max_model_len=args.max_model_len,
        )
        asyncio.run(vllm_server.serve(args.host, port, args.model, args.gpu, args.tp, args.speed, options))
        return 0
    if args.generation_config or args.max_model_len:
        raise SystemExit(
            "--generation-config and --max-model-len are vLLM's flags: SGLang's /generate applies no model "
            "generation config (--preferred-sampling-params is its server default) and its limit is "
            "--context-length"
        )
    from loom.engine.fakes import sglang_server

    preferred = json.loads(args.preferred_sampling_params) if args.preferred_sampling_params else {}
    flags = sglang_server.Options(preferred_sampling_params=preferred, context_length=args.context_length)
    asyncio.run(sglang_server.serve(args.host, port, args.model, args.gpu, args.tp, args.speed, flags))
    return 0

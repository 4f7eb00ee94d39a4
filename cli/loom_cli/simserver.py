"""``loom sim-server``: the simulated engine behind SGLang's or vLLM's HTTP API."""

from __future__ import annotations

import argparse
import asyncio

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
    p.add_argument(
        "--generation-config",
        help="vLLM only: a checkpoint's generation_config.json (or its directory), whose sampling fills every "
        "field a request leaves out, as vLLM's --generation-config auto does",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logs.configure("sim-server", "INFO")
    port = DEFAULT_PORTS[args.api] if args.port is None else args.port
    if args.api == "vllm":
        from loom.engine.fakes.vllm_server import serve as serve_vllm

        asyncio.run(
            serve_vllm(args.host, port, args.model, args.gpu, args.tp, args.speed, args.generation_config)
        )
        return 0
    if args.generation_config:
        raise SystemExit(
            "SGLang's /generate applies no model generation config (only its OpenAI chat route does)"
        )
    from loom.engine.fakes.sglang_server import serve

    asyncio.run(serve(args.host, port, args.model, args.gpu, args.tp, args.speed))
    return 0

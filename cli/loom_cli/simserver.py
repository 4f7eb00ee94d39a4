"""``loom sim-server``: the simulated engine behind an SGLang-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio

from loom import logs
from loom.engine.sglang_server import serve


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "sim-server",
        help="serve the simulated engine over SGLang's HTTP API (for LOOM_ROLLOUT_ENGINE=sglang)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="SGLang's default port; 0 picks a free one")
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--speed", type=float, default=1.0, help="simulated time runs this many times faster")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    logs.configure("sim-server", "INFO")
    asyncio.run(serve(args.host, args.port, args.model, args.gpu, args.tp, args.speed))
    return 0

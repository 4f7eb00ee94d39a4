"""``loom``: run the embedded system, submit jobs, read results."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loom import logs
from loom.engine import kinds as engine_kinds
from loom.envs.adapters import gem
from loom.runtime import lifecycle
from loom.runtime.natsserver import refusals
from loom_cli import bench, images, learned_predictor, plan, predictor, simserver, trace, train_args
from loom_cli.client import ApiError, LoomClient
from loom_cli.deploy import (
    DeployConfig,
    DeployError,
    Deployment,
    api_token,
    default_home,
    gather_health,
    read_state,
)


def _api(args: argparse.Namespace) -> LoomClient:
    url = args.api or str(read_state(args.home)["api_url"])
    return LoomClient(url, api_token(args.home))


def _engine_urls(engine: str) -> list[str]:
    """The servers a rollout worker of ``engine`` drives, from its setting (comma-separated for several)."""
    setting = engine_kinds.kind(engine).url_setting
    raw = os.environ.get(setting, "") if setting else ""
    return [u.strip() for u in raw.split(",") if u.strip()]


async def _up(args: argparse.Namespace) -> int:
    env = learned_predictor.ensure(Console(stderr=True), args.predictor_steps)
    cfg = DeployConfig(
        home=args.home,
        workers=args.workers,
        speed=args.speed,
        api_port=args.port,
        nats_port=args.nats_port,
        model=args.model,
        gpu=args.gpu,
        log_level=args.log_level,
        engine=args.engine,
        model_path=args.model_path,
        # The rollout settings' own variables work too: LOOM_ROLLOUT_ENGINE=vllm LOOM_ROLLOUT_VLLM_URL=... loom up
        engine_urls=args.engine_url or _engine_urls(args.engine),
        nats_cluster=args.nats_cluster,
        schedulers=args.schedulers,
        routers=args.routers,
        extra_env=env,
        gem_python=args.gem_python or None,
    )
    dep = Deployment(cfg)
    try:
        dep.check()
    except DeployError as e:
        print(f"loom: {e}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await dep.start(wait_s=args.wait)
        except DeployError as e:
            print(f"loom: {e}", file=sys.stderr)
            return 1
        print(f"Loom is up: API {dep.api_url}, NATS {dep.nats.url}, logs {cfg.home / 'logs'}", flush=True)
        print(f"Dashboard: {dep.api_url}/ui?token=<the API token> (`loom ui` prints the link)", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        await stop.wait()
    finally:
        print("stopping...", file=sys.stderr, flush=True)
        await dep.stop()
    return 0


async def _status(args: argparse.Namespace) -> int:
    state = read_state(args.home)
    health = await gather_health(str(state["nats_url"]), wait=1.0, home=args.home)
    t = Table(title=f"Loom at {state['api_url']}")
    for c in ("service", "instance", "pid", "up (s)", "details"):
        t.add_column(c)
    missing = []
    for svc, hs in health.items():
        if not hs:
            missing.append(svc)
            t.add_row(svc, "-", "-", "-", "[red]no answer[/]")
        for h in sorted(hs, key=lambda h: h.instance):
            details = json.dumps(h.details)[:80]
            t.add_row(
                svc,
                h.instance,
                str(h.pid),
                f"{h.uptime_s:.0f}",
                details if h.ready else f"[yellow]starting[/] {details}",
            )
    console = Console()
    console.print(t)
    refused = refusals(args.home / "nats" / "nats-server.log")
    console.print("NATS refused: " + ", ".join(f"{k} {v}" for k, v in refused.items()))
    return 1 if missing else 0


def _submit(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.file).read_text())
    client = _api(args)
    job = client.submit(spec)
    print(json.dumps({"id": job["id"], "state": job["state"], "n_trajectories": job["n_trajectories"]}))
    return 0


def _results(args: argparse.Namespace) -> int:
    client = _api(args)
    lines: Iterable[bytes] = client.trajectories(args.job)
    if args.format == "trace":
        lines = trace.results_as_trace(lines)
    out = open(args.out, "wb") if args.out else sys.stdout.buffer  # noqa: SIM115
    try:
        for line in lines:
            out.write(line + b"\n")
    finally:
        if args.out:
            out.close()
    return 0


def _cancel(args: argparse.Namespace) -> int:
    job = _api(args).cancel(args.job)
    print(json.dumps({"id": job["id"], "state": job["state"]}))
    return 0


def _job(args: argparse.Namespace) -> int:
    print(json.dumps(_api(args).job(args.job), indent=2))
    return 0


def _ui(args: argparse.Namespace) -> int:
    """The dashboard's link with the token that opens it (the browser swaps it for a session cookie)."""
    url = args.api or str(read_state(args.home)["api_url"])
    print(f"{url.rstrip('/')}/ui?{urllib.parse.urlencode({'token': api_token(args.home)})}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom", description=__doc__)
    p.add_argument("--home", type=Path, default=default_home(), help="state directory of `loom up` (.loom)")
    p.add_argument("--api", help="scheduler URL (default: from the running `loom up`)")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start nats-server and every service, supervised; Ctrl-C stops")
    up.add_argument("--workers", type=int, default=4, help="simulated rollout workers")
    up.add_argument("--speed", type=float, default=1.0, help="simulated time runs this many times faster")
    up.add_argument("--port", type=int, default=8080, help="scheduler REST port")
    up.add_argument("--nats-port", type=int, default=0, help="NATS port (0: any free port)")
    up.add_argument("--model", default="qwen3-8b")
    up.add_argument(
        "--engine",
        choices=tuple(engine_kinds.KINDS),
        default=os.environ.get("LOOM_ROLLOUT_ENGINE", "sim"),
        help="; ".join(f"{k.name}: {k.help}" for k in engine_kinds.KINDS.values()),
    )
    up.add_argument(
        "--engine-url",
        action="append",
        help="an SGLang or vLLM server's base URL; repeat for several (workers take them in turn)",
    )
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=0,
        help="run this many clustered nats-servers (3 or more) with every stream replicated, instead of one",
    )
    up.add_argument(
        "--schedulers", type=int, default=1, help="scheduler instances: one active, the rest standby"
    )
    up.add_argument("--routers", type=int, default=1, help="router instances: one active, the rest standby")
    up.add_argument(
        "--model-path", help="checkpoint directory (config.json, safetensors) the hf engine serves"
    )
    up.add_argument("--gpu", default="h100")
    up.add_argument(
        "--gem-python",
        default=gem.default_python(),
        help="interpreter of GEM's virtualenv, to start an environment manager for `gem:` jobs from "
        f"(default: ${gem.PYTHON_ENV}, else .venv-gem where built; '' for none)",
    )
    up.add_argument("--log-level", default="INFO")
    up.add_argument(
        "--wait",
        type=float,
        default=300.0,
        help="seconds to wait for every service to serve (a worker's engine loads its checkpoint first); "
        "a service that keeps crashing fails it sooner",
    )
    up.add_argument(
        "--predictor-steps",
        type=int,
        default=learned_predictor.DEFAULT_STEPS,
        help=f"train a length predictor for this many steps where none exists (0: none; default "
        f"{learned_predictor.DEFAULT_STEPS}, about a minute)",
    )

    sub.add_parser("status", help="health of every service instance")
    sub.add_parser("ui", help="the live dashboard's link, signed in (keep it private: it holds the token)")
    s = sub.add_parser("submit", help="submit a job spec (JSON file)")
    s.add_argument("file")
    r = sub.add_parser("results", help="a job's scored trajectories as NDJSON")
    r.add_argument("job")
    r.add_argument("-o", "--out", help="write to this file instead of stdout")
    r.add_argument(
        "--format",
        choices=("loom", "trace"),
        default="loom",
        help="loom: the stored trajectories; trace: the rollout-trace schema (replay with bench --workload)",
    )
    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job")
    j = sub.add_parser("job", help="a job's status")
    j.add_argument("job")

    bench.register(sub)
    simserver.register(sub)
    predictor.add_parser(sub)
    images.add_parser(sub)
    trace.add_parser(sub)
    plan.add_parser(sub)
    train_args.add_parser(sub)

    d = sub.add_parser("demo", help="run a replayed demo job end to end and print a summary")
    d.add_argument("--prompts", type=int, default=8)
    d.add_argument("--samples", type=int, default=8)
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--speed", type=float, default=20.0)
    d.add_argument("--policy", help='job policy as JSON, e.g. \'{"preset": "slime"}\' (default: heddle)')
    d.add_argument(
        "--predictor-steps",
        type=int,
        default=learned_predictor.DEFAULT_STEPS,
        help=f"train a length predictor for this many steps where none exists (0: none; default "
        f"{learned_predictor.DEFAULT_STEPS}, about a minute)",
    )
    rm = sub.add_parser(
        "rollmux-demo", help="three trainer processes co-scheduled over NATS; Gantt of what ran"
    )
    rm.add_argument("--time-scale", type=float, default=0.01, help="wall seconds per planned second")
    rm.add_argument("--iterations", type=int, default=3)
    rm.add_argument("--out", default="bench-out/rollmux", help="where the Gantt PNG goes")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logs.configure("loom", "WARNING")
    # Job schedulers and `timeout` stop a command with SIGTERM: it stops what it started, as Ctrl-C does.
    lifecycle.sigterm_as_interrupt()
    try:
        if args.cmd == "up" and args.gem_python and not Path(args.gem_python).exists():
            print(
                f"loom: --gem-python {args.gem_python} does not exist (`make install` builds .venv-gem)",
                file=sys.stderr,
            )
            rc = 2
        elif args.cmd == "up":
            rc = asyncio.run(_up(args))
        elif args.cmd == "status":
            rc = asyncio.run(_status(args))
        elif args.cmd == "bench":
            rc = bench.run(args)
        elif args.cmd == "predictor":
            rc = predictor.run(args)
        elif args.cmd == "images":
            rc = images.run(args)
        elif args.cmd == "trace":
            rc = args.func(args)
        elif args.cmd == "plan":
            rc = plan.run(args)
        elif args.cmd == "train":
            from loom_cli.train import run as train

            rc = train(args)
        elif args.cmd == "sim-server":
            rc = args.run(args)
        elif args.cmd == "rollmux-demo":
            from loom_cli.rollmux_demo import main as rollmux_demo

            rc = rollmux_demo(args)
        elif args.cmd == "demo":
            from loom_cli.demo import run_demo

            policy = json.loads(args.policy) if args.policy else None
            rc = asyncio.run(
                run_demo(
                    args.prompts, args.samples, args.workers, args.speed, None, policy, args.predictor_steps
                )
            )
        else:
            commands = {"submit": _submit, "results": _results, "cancel": _cancel, "job": _job, "ui": _ui}
            rc = commands[args.cmd](args)
    except ApiError as e:
        print(f"loom: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        rc = 130
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    sys.exit(rc)


if __name__ == "__main__":
    main()

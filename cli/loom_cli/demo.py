"""``loom demo``: start the embedded system, run a replayed job to the end, summarise it, stop."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loom_cli import learned_predictor
from loom_cli.client import LoomClient
from loom_cli.deploy import DeployConfig, Deployment, free_port, gather_health
from loom_cli.summary import summarize


def demo_spec(prompts: int, samples: int, policy: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "name": "demo: SWE-bench agent replay",
        "env": "replay",
        "model": "qwen3-8b",
        "dataset": {"name": "swe-replay", "limit": prompts},
        "group_size": samples,
        "policy": policy or {"preset": "heddle"},
    }


async def run_demo(
    prompts: int,
    samples: int,
    workers: int,
    speed: float,
    home: Path | None,
    policy: dict[str, Any] | None = None,
    predictor_steps: int = learned_predictor.DEFAULT_STEPS,
) -> int:
    console = Console(stderr=True)
    t0 = time.monotonic()
    env = learned_predictor.ensure(console, predictor_steps)
    t_model = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="loom-demo-") as tmp:
        cfg = DeployConfig(
            home=home or Path(tmp), workers=workers, speed=speed, api_port=free_port(), extra_env=env
        )
        dep = Deployment(cfg)
        console.print(
            f"[bold]Loom demo[/]: {workers} simulated workers, time x{speed:g}, logs in {cfg.home}/logs"
        )
        try:
            await dep.start()
            t_up = time.monotonic()
            health = await gather_health(dep.nats.url, 1.0, cfg.home)
            summary = await asyncio.to_thread(
                _run_job, dep.api_url, dep.api_token, demo_spec(prompts, samples, policy), console
            )
            t_job = time.monotonic()
        finally:
            await dep.stop()
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    summary["phases_s"] = {
        "predictor": round(t_model - t0, 1),
        "start": round(t_up - t_model, 1),
        "job": round(t_job - t_up, 1),
    }
    served = [h.details.get("method", "?") for h in health.get("predictor", [])]
    summary["predictor"] = served[0] if served else "unknown"
    summary["speed"] = speed
    _print_table(console, summary)
    out = {
        k: summary[k]
        for k in ("trajectories", "completed", "failed", "makespan_s", "throughput_tok_s", "step_latency_ms")
    }
    out |= {
        "wall_s": summary["wall_s"],
        "phases_s": summary["phases_s"],
        "speed": speed,
        "predictor": summary["predictor"],
    }
    print(json.dumps(out), flush=True)
    return 0 if summary["completed"] == summary["trajectories"] else 1


def _run_job(api_url: str, token: str, spec: dict[str, Any], console: Console) -> dict[str, Any]:
    client = LoomClient(api_url, token)
    try:
        job = client.submit(spec)
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=console, transient=False) as progress:
            bar = progress.add_task(f"job {job['id']}", total=job["n_trajectories"])
            while job["state"] not in ("completed", "cancelled", "failed"):
                time.sleep(0.5)
                job = client.job(job["id"])
                progress.update(bar, completed=job["completed"] + job["failed"])
        t0 = time.monotonic()
        trajs = [json.loads(line) for line in client.trajectories(job["id"])]
        out = summarize(job, trajs)
        out["fetch_s"] = round(time.monotonic() - t0, 2)
        return out
    finally:
        client.close()


def _print_table(console: Console, s: dict[str, Any]) -> None:
    t = Table(title="Demo job", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("trajectories", f"{s['completed']} completed / {s['trajectories']} ({s['failed']} failed)"),
        ("LLM steps", f"{s['steps']:,}"),
        ("output tokens", f"{s['output_tokens']:,}"),
        ("makespan (simulated)", f"{s['makespan_s']:.1f} s"),
        ("throughput (simulated)", f"{s['throughput_tok_s']:,.0f} tok/s"),
        (
            "step latency p50 / p99",
            f"{s['step_latency_ms']['p50']:.0f} / {s['step_latency_ms']['p99']:.0f} ms",
        ),
        ("mean reward (resolved)", f"{s['mean_reward']}"),
        ("workers used", ", ".join(s["workers"])),
        ("length predictor", s["predictor"]),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)

"""``loom rollmux-demo``: three trainer processes co-scheduled by the scheduler service over NATS.

Starts a private nats-server and the scheduler, registers three RL jobs (``POST /v1/rljobs``), runs one
trainer process per job, then checks the recorded timeline against the plan: jobs of one group never hold
the training pool at once, and share a rollout node only while one of them is a migrated tail on the GPUs
the other left free. Draws the Gantt of what actually ran.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loom.bench.rollmux_plots import GanttRow, gantt
from loom.identity.auth import header, new_token
from loom.runtime.natsserver import NatsServer
from loom.runtime.supervisor import ProcSpec, Supervisor
from loom_cli.deploy import free_port

# A rollout-heavy job, a train-heavy one that fills its training bubble (direct packing on its rollout
# node), and a third that only fits with a rollout node of its own (rollout scaling). Seconds at full scale.
DEMO_JOBS = (
    {"name": "agentic-7b", "model": "7b", "rollout_s": 300, "train_s": 100, "slo": 1.3},
    {"name": "rlhf-7b", "model": "7b", "rollout_s": 100, "train_s": 150, "slo": 2.0},
    {"name": "math-7b", "model": "7b", "rollout_s": 250, "train_s": 100, "slo": 2.0},
)


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float] | None:
    lo, hi = max(a["start"], b["start"]), min(a["end"], b["end"])
    return (lo, hi) if lo < hi else None


def check_timeline(runs: list[dict[str, Any]], gpus_per_node: int = 8) -> tuple[list[str], int]:
    """Violations of the plan in what ran, and how many overlaps were allowed by a tail migration."""
    violations, tails = [], 0
    for a, b in itertools.combinations(runs, 2):
        if a["job"] == b["job"] or a["group"] != b["group"] or a["phase"] != b["phase"]:
            continue
        span = _overlap(a, b)
        if span is None:
            continue
        if a["phase"] == "train":
            violations.append(f"{a['job']} and {b['job']} trained at once over {span[1] - span[0]:.3f} s")
            continue
        for n in set(a["nodes"]) & set(b["nodes"]):
            first, second = (a, b) if a["start"] <= b["start"] else (b, a)
            migrated = first.get("migrated_at")
            fits = first.get("tail_gpus", gpus_per_node) + second["gpus"][str(n)] <= gpus_per_node
            if migrated is not None and migrated <= second["start"] and fits:
                tails += 1
            else:
                violations.append(
                    f"{a['job']} and {b['job']} both rolled out on node {n} without a migration"
                )
    return violations, tails


async def _wait_http(
    url: str, headers: dict[str, str], sup: Supervisor, logs: Path, within_s: float = 30.0
) -> None:
    deadline = time.monotonic() + within_s
    async with httpx.AsyncClient(headers=headers) as http:
        while time.monotonic() < deadline:
            if sup.restarts()["scheduler"]:
                raise RuntimeError(f"the scheduler crashed at start; see {logs / 'scheduler.log'}")
            try:
                if (await http.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"the scheduler did not answer at {url}")


async def run_demo(time_scale: float, iterations: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="loom-rollmux-") as tmp:
        work = Path(tmp)
        server = NatsServer(work / "nats")
        url = await server.start()
        port = free_port()
        api = f"http://127.0.0.1:{port}"
        token = new_token()  # the scheduler's admin token for this run alone
        headers = header(token)
        env = {
            "LOOM_NATS_URL": url,
            "LOOM_SCHEDULER_PORT": str(port),
            "LOOM_API_TOKEN": token,
            "PYTHONUNBUFFERED": "1",
        }
        sup = Supervisor(work / "logs")
        try:
            await sup.start(ProcSpec("scheduler", [sys.executable, "-m", "services.scheduler"], env))
            await _wait_http(api, headers, sup, work / "logs")
            async with httpx.AsyncClient(headers=headers) as http:
                placements = []
                for spec in DEMO_JOBS:
                    r = await http.post(f"{api}/v1/rljobs", json=spec)
                    r.raise_for_status()
                    placements.append(r.json())
                groups = (await http.get(f"{api}/v1/rljobs")).json()
            trainers = [
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "loom_cli.rollmux_trainer",
                    "--nats",
                    url,
                    "--job",
                    str(spec["name"]),
                    "--rollout-s",
                    str(spec["rollout_s"]),
                    "--train-s",
                    str(spec["train_s"]),
                    "--iterations",
                    str(iterations),
                    "--time-scale",
                    str(time_scale),
                    "--out",
                    str(work / f"{spec['name']}.jsonl"),
                )
                for spec in DEMO_JOBS
            ]
            codes = [await t.wait() for t in trainers]
            runs = [
                json.loads(line)
                for spec in DEMO_JOBS
                if (work / f"{spec['name']}.jsonl").exists()
                for line in (work / f"{spec['name']}.jsonl").read_text().splitlines()
            ]
        finally:
            await sup.stop()
            await server.stop()
    return {"placements": placements, "groups": groups["groups"], "trainer_exit_codes": codes, "runs": runs}


def summarise(ran: dict[str, Any], out_dir: Path, time_scale: float) -> dict[str, Any]:
    runs, placements = ran["runs"], ran["placements"]
    violations, tails = check_timeline(runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = min((r["start"] for r in runs), default=0.0)
    rows: list[GanttRow] = []
    for r in runs:
        lanes = (
            ["train"] if r["phase"] == "train" else [f"g{r['group']} rollout node {n}" for n in r["nodes"]]
        )
        cut = r.get("migrated_at", r["end"])
        for lane in lanes:
            rows.append((lane, r["job"], r["phase"], (r["start"] - t0) / time_scale, (cut - t0) / time_scale))
            if "migrated_at" in r and lane.endswith(f"node {r['tail_node']}"):
                rows.append((lane, r["job"], "tail", (cut - t0) / time_scale, (r["end"] - t0) / time_scale))
    plot = gantt(
        out_dir / "rollmux_demo_gantt.png", rows, "Three trainer processes under RollMux permits (as run)"
    )
    trains = sorted(r["end"] for r in runs if r["phase"] == "train" and r["job"] == DEMO_JOBS[0]["name"])
    measured = [(b - a) / time_scale for a, b in itertools.pairwise(trains)]
    return {
        "placements": placements,
        "groups": ran["groups"],
        "trainer_exit_codes": ran["trainer_exit_codes"],
        "phases_run": len(runs),
        "violations": violations,
        "tail_migrations": sum("migrated_at" in r for r in runs),
        "overlaps_from_migration": tails,
        "meta_iteration_s": [round(m, 1) for m in measured],
        "planned_period_s": [round(p["period_s"], 1) for p in placements],
        "gantt": str(plot),
    }


def main(args: Any) -> int:
    ran = asyncio.run(run_demo(args.time_scale, args.iterations))
    result = summarise(ran, Path(args.out), args.time_scale)
    print(json.dumps(result), flush=True)
    ok = not result["violations"] and all(c == 0 for c in result["trainer_exit_codes"])
    return 0 if ok and result["phases_run"] == 2 * args.iterations * len(DEMO_JOBS) else 1

"""``loom bench weights``: a new version to the rollout fleet by each transport (``loom.weights``), measured on
this machine, and the training step each gives at RollArt's scale in virtual time.

``transports``: a Qwen3 built from a config (``model_bytes``: 0.68 GB in BF16 in the full run) goes from this
process, the trainer, to ``--workers`` rollout workers (real processes behind a real scheduler over a real
nats-server, the simulated engine, which reads a checkpoint's safetensors, or receives a broadcast or a
store's version, for real, and checks it) by ``disk`` (written by the trainer, read by every worker),
``collective`` (a gloo broadcast) and ``store`` (the bus's object store). ``update_s`` runs from the trainer
holding the new weights to the answer that every worker serves them (median of ``--repeats``);
``bytes_per_s`` is the model's bytes over it. Meanwhile long generations keep every worker busy, and
``tokens_lost`` is the rollout throughput (tokens/s) the update costs, over its span: with the pause that
keeps requests (Loom's), the tokens not generated while paused; had the pause aborted them (vLLM's and
SGLang's default pause modes), the tokens they had generated too, which must be generated again.

``harness``: for Qwen3-8B, 14B and 32B, the training harness's step time (``loom.bench.harness.training``,
RollArt's mix, asynchronous bound 1) on RollArt's affinity pools (64 H800 beside the trainer, 24 H20 in
another cluster), the weights moving by ``disk`` (every engine reads a checkpoint at the rate measured above,
in the pause), by a synchronous broadcast (veRL's: every engine pauses until the slowest link delivered), or
by the asynchronous cross-cluster store (RollArt §5.2: the far pool fetches while it generates), with the
far pool's link at Table 3's ``tcp`` and ``rdma`` rates; ``async_over_sync`` is the synchronous step over
the asynchronous one (RollArt Fig. 11b: 1.10-1.16x over TCP), and ``bound`` the most any asynchronous update
could give: the synchronous step over itself less the whole transfer (Table 3's seconds). Where the bound is
below Fig. 11b's figure, the harness's steps are too long for the transfer to weigh that much.

On this 2-core machine the transfer's own work (writing, reading, checking the bytes) slows the simulated
fleet's clock too, so ``tokens_lost`` holds that as well as the pause; both pause modes pay it alike.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from rich.console import Console
from rich.table import Table

from loom.bench.harness.training import Mode, Pool
from loom.bench.registry import Benchmark
from loom.bench.training_cells import TP, Cell, run_cells
from loom.bench.weights_model import build_model
from loom.engine.model.train_perf import weight_sync_s
from loom.protocol import AbortRequest, DatasetRef, GenRequest, StreamSpec, encode, subjects
from loom.runtime import bus
from loom.runtime.genclient import GenClient, GenFailed
from loom.runtime.lifecycle import free_port
from loom.runtime.natsserver import NatsServer

ROOT = Path(__file__).resolve().parents[3]
FLEET_MODEL = "qwen3-8b"  # what the simulated workers time their generation as
TRANSPORTS = ("disk", "collective", "store")
MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
AFFINITY = (("coding", "h800"), ("default", "h20"))
FIG11B = (1.10, 1.16)
LOAD_REQUESTS = 8  # generations kept running per worker
# Each; at the workers' speed-up one takes about 2 s, so the fleet holds thousands of tokens in flight, which a
# pause that aborts throws away.
LOAD_TOKENS = 2048
LOAD_SPEED = "20"  # simulated seconds per wall second on the workers
# The window the fleet's rate is taken over before an update, and the one after it whose completions still
# hold tokens it delayed (full run; --quick halves both and the generations).
RATE_S = 6.0
TAIL_S = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="rollout workers (processes), at least 2")
    p.add_argument("--repeats", type=int, default=None, help="updates per transport (default 3, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="harness steps per run (default 10, quick 5)")
    p.add_argument("--no-harness", action="store_true", help="measure the transports only")


class Load:
    """Generations kept running on the fleet, each started again as it ends: the tokens it completes, when."""

    def __init__(self, nc: Any, per_worker: int, workers: int, tokens: int) -> None:
        self.max_tokens = tokens
        self.nc = nc
        self.gen = GenClient(nc, lease_s=10.0, give_up_s=600.0)
        self.done: list[tuple[float, int]] = []  # (when, tokens) of each generation that ran to its end
        self.inflight: set[str] = set()
        self.tasks = [asyncio.ensure_future(self._loop(k)) for k in range(per_worker * workers)]

    async def _loop(self, k: int) -> None:
        for i in itertools.count():
            rid = f"load-{k}-{i}.0"
            self.inflight.add(rid)
            req = GenRequest(rid=rid, job_id="bench", traj_id=f"load-{k}-{i}", step=0, input_len=200,
                             max_new_tokens=self.max_tokens, ignore_eos=True)  # fmt: skip
            try:
                out = await self.gen.generate(req)
            except GenFailed:
                continue  # aborted: its tokens are lost, the loop asks again
            finally:
                self.inflight.discard(rid)
            if out.finish_reason == "length":
                self.done.append((time.monotonic(), out.output_len))

    def tokens(self, since: float, until: float) -> int:
        return sum(n for t, n in self.done if since <= t < until)

    async def abort_all(self) -> None:
        """What a pause in "abort" mode does to the requests in flight (vLLM's and SGLang's default)."""
        for rid in list(self.inflight):
            await self.nc.publish(subjects.GEN_ABORT, encode(AbortRequest(rid=rid)))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _spawn(module: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, "-m", module, cwd=ROOT, env=env)


async def _stop(procs: list[asyncio.subprocess.Process]) -> None:
    for p in procs:
        if p.returncode is None:
            p.terminate()
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 20)
        except TimeoutError:
            p.kill()
            await p.wait()


async def measure_transports(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from loom.trainer.client import StreamClient
    from loom.weights.publish import state_of, transport

    model = build_model(args.quick)
    model_bytes = sum(t.numel() * t.element_size() for t in state_of(model).values())
    repeats = args.repeats or (1 if args.quick else 3)
    workers = max(2, args.workers)
    with tempfile.TemporaryDirectory(prefix="loom-bench-weights-") as tmp:
        server = NatsServer(Path(tmp) / "nats", port=0)
        url = await server.start()
        env = dict(
            os.environ,
            LOOM_NATS_URL=url,
            LOOM_LOG_LEVEL=os.environ.get("LOOM_BENCH_LOG_LEVEL", "WARNING"),
            LOOM_SCHEDULER_PORT=str(free_port()),
            LOOM_API_TOKEN=secrets.token_hex(16),  # the scheduler's REST edge wants one; nothing here uses it
            LOOM_ROLLOUT_ENGINE="sim",
            LOOM_ROLLOUT_MODEL=FLEET_MODEL,
            LOOM_ROLLOUT_SPEED=LOAD_SPEED,
        )
        nc = await nats.connect(url)
        procs: list[asyncio.subprocess.Process] = []
        try:
            await bus.ensure_streams(nc.jetstream())
            procs.append(await _spawn("services.scheduler", {**env, "LOOM_INSTANCE": "scheduler"}))
            procs.append(await _spawn("services.router", {**env, "LOOM_INSTANCE": "router"}))
            for i in range(workers):
                procs.append(
                    await _spawn(
                        "services.rollout",
                        {**env, "LOOM_INSTANCE": f"w{i}", "LOOM_ROLLOUT_WORKER_ID": f"w{i}"},
                    )
                )
            await _registered(nc, workers, procs)
            spec = StreamSpec(
                model=FLEET_MODEL, dataset=DatasetRef("swe-replay", limit=1), group_size=1, lease_s=600.0
            )
            stream = await StreamClient.create(nc, spec, timeout_s=120)
            scale = 0.5 if args.quick else 1.0
            load = Load(nc, LOAD_REQUESTS, workers, int(LOAD_TOKENS * scale))
            movers = {
                "disk": transport("disk", root=Path(tmp) / "ckpt"),
                "collective": transport("collective"),
                "store": transport("store", js=nc.jetstream(timeout=120)),
            }
            out: dict[str, Any] = {}
            try:
                await asyncio.sleep(3.0)  # every worker generating
                version = 0
                for name in TRANSPORTS:
                    runs: dict[str, list[dict[str, float]]] = {"pause_keep": [], "abort": []}
                    for _ in range(repeats):
                        for pause in runs:
                            version += 1
                            runs[pause].append(
                                await _one_update(
                                    stream,
                                    load,
                                    version,
                                    model,
                                    movers[name],
                                    pause,
                                    RATE_S * scale,
                                    TAIL_S * scale,
                                )
                            )
                    keep = runs["pause_keep"]
                    med = statistics.median(r["update_s"] for r in keep)
                    out[name] = {
                        "update_s": round(med, 3),
                        "bytes_per_s": round(model_bytes / med),
                        "pause_s": round(statistics.median(r["pause_s"] for r in keep), 3),
                        "fetch_s": round(statistics.median(r["fetch_s"] for r in keep), 3),
                        "tokens_lost": {
                            p: round(statistics.median(r["lost"] for r in rs), 1) for p, rs in runs.items()
                        },
                        "fleet_tokens_per_s": round(statistics.median(r["rate"] for r in keep), 1),
                        "updates": repeats,
                    }
                    console.print(
                        f"{name}: update {out[name]['update_s']} s, {out[name]['bytes_per_s'] / 1e6:.0f} MB/s"
                    )
            finally:
                await load.stop()
                await stream.close()
        finally:
            await nc.close()
            await _stop(procs)
            await server.stop()
    return {"model_bytes": model_bytes, "workers": workers, "transports": out}


async def _registered(nc: Any, workers: int, procs: list[asyncio.subprocess.Process]) -> None:
    kv = await nc.jetstream().key_value(subjects.KV_WORKERS)
    deadline = time.monotonic() + 120
    while True:
        try:
            if len(await kv.keys()) >= workers:
                return
        except Exception:
            pass
        if time.monotonic() > deadline or any(p.returncode is not None for p in procs):
            raise RuntimeError("the fleet did not come up")
        await asyncio.sleep(0.2)


async def _one_update(
    stream: Any, load: Load, version: int, model: Any, mover: Any, pause: str, rate_s: float, tail_s: float
) -> dict[str, float]:
    """One update under the load: its time, and the rollout tokens/s it cost (the tokens the fleet would have
    completed at its rate just before, less those it completed, over the update and the second after it,
    whose completions still hold tokens the update delayed or threw away)."""
    await asyncio.sleep(rate_s)  # the window after the last update's own
    before = time.monotonic()
    rate = load.tokens(before - rate_s, before) / rate_s
    t0 = time.monotonic()
    if pause == "abort":
        await load.abort_all()
    res = await stream.update_weights(version, model=model, transport=mover, timeout=600)
    t1 = time.monotonic()
    await asyncio.sleep(tail_s)
    window = time.monotonic() - t0
    lost = max(0.0, rate * window - load.tokens(t0, t0 + window))
    span = t1 - t0
    return {
        "update_s": span,
        "pause_s": res.pause_s,
        "fetch_s": res.fetch_s,
        "lost": lost / span,
        "rate": rate,
    }


def harness_cells(models: tuple[str, ...], disk_bytes_per_s: float, steps: int) -> list[Cell]:
    cells = []
    for m in models:
        tp = TP[m]
        near = Pool("h800", 64, tp, "rdma")
        runs: dict[str, tuple[tuple[Pool, ...], Mode]] = {
            "disk": ((Pool("h800", 64, tp, "rdma", disk_bytes_per_s), Pool("h20", 24, tp, "tcp", disk_bytes_per_s)), Mode.asynchronous(1)),
        }  # fmt: skip
        for link in ("tcp", "rdma"):
            both = (near, Pool("h20", 24, tp, link))
            runs[f"sync-{link}"] = (both, Mode.asynchronous(1))
            runs[f"async-{link}"] = (both, Mode.asynchronous(1).with_async_update())
        for label, (pools, mode) in runs.items():
            cells.append(Cell(m, mode, pools, 32, 64, steps, 2, 0, label, AFFINITY))
    return cells


def run_harness(args: argparse.Namespace, disk_bytes_per_s: float) -> dict[str, Any]:
    models = ("qwen3-8b",) if args.quick else MODELS
    steps = args.steps or (5 if args.quick else 10)
    cells = harness_cells(models, disk_bytes_per_s, steps)
    rows = run_cells(cells, 2)
    out: dict[str, Any] = {}
    for c, r in zip(cells, rows, strict=True):
        out.setdefault(c.model, {})[c.label] = {"step_time_s": r["step_time_s"]}
    for model, runs in out.items():
        for link in ("tcp", "rdma"):
            runs[link] = {
                "sync_step_s": runs.pop(f"sync-{link}")["step_time_s"],
                "async_step_s": runs.pop(f"async-{link}")["step_time_s"],
            }
            runs[link]["async_over_sync"] = round(runs[link]["sync_step_s"] / runs[link]["async_step_s"], 3)
            # The most an asynchronous update can give: the synchronous step without its whole transfer.
            sync = runs[link]["sync_step_s"]
            runs[link]["bound"] = round(sync / max(1e-9, sync - weight_sync_s(model, link)), 3)
        runs["disk_step_s"] = runs.pop("disk")["step_time_s"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    console = Console(stderr=True)
    wall0 = time.perf_counter()
    measured = asyncio.run(measure_transports(args, console))
    tr = measured["transports"]
    out: dict[str, Any] = {"benchmark": "weights", **measured}
    out["collective_faster_than_disk"] = tr["collective"]["update_s"] < tr["disk"]["update_s"]
    if not args.no_harness:
        out["harness"] = run_harness(args, tr["disk"]["bytes_per_s"])
        tcp = [h["tcp"] for h in out["harness"].values()]
        out["fig11b"] = {
            "paper": FIG11B,
            "min_async_over_sync_tcp": min(h["async_over_sync"] for h in tcp),
            "min_bound_tcp": min(h["bound"] for h in tcp),
            "met": min(h["async_over_sync"] for h in tcp) >= FIG11B[0],
        }
    out["wall_s"] = round(time.perf_counter() - wall0, 1)
    _print(out, console)
    return out


def _print(out: dict[str, Any], console: Console) -> None:
    t = Table(title=f"Moving {out['model_bytes'] / 1e9:.2f} GB to {out['workers']} workers")
    for col in ("transport", "update s", "MB/s", "pause s", "fetch s", "tokens/s lost (keep)", "(abort)"):
        t.add_column(col)
    for name, r in out["transports"].items():
        t.add_row(name, str(r["update_s"]), f"{r['bytes_per_s'] / 1e6:.0f}", str(r["pause_s"]), str(r["fetch_s"]),
                  str(r["tokens_lost"]["pause_keep"]), str(r["tokens_lost"]["abort"]))  # fmt: skip
    console.print(t)
    for m, h in out.get("harness", {}).items():
        console.print(
            f"{m}: disk {h['disk_step_s']} s; tcp sync {h['tcp']['sync_step_s']} / async {h['tcp']['async_step_s']}"
            f" = {h['tcp']['async_over_sync']}x (bound {h['tcp']['bound']}x); rdma {h['rdma']['async_over_sync']}x"
        )


BENCHMARK = Benchmark(
    "weights", "moving new weights to the fleet: disk, collective, store", add_arguments, run
)

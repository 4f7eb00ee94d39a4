"""``loom bench weights-colocated``: a trainer and a rollout engine on one device (verl's hybrid engine, vLLM's
IPC weight-transfer engine), each version handed from the trainer's process to the engine's.

This process is the trainer; the engine is a process of its own holding a transformers Qwen3 (built from the
config ``loom bench weights`` uses, 0.68 GB in BF16) on the same device, which takes each version as Loom's
transformers engine takes one (``Incoming.tensors``, then the serving architecture's ``load_state_dict``,
strict) and answers with its logits on a fixed batch, checked against the trainer's. ``update_s`` runs from
the trainer holding the new weights to that answer (median of ``--repeats``), by:

- ``ipc``: the collective transport's ``ipc`` format. On a GPU the buckets are packed on the device and
  handed over by CUDA IPC (NCCL cannot put two ranks on one GPU); on CPUs, by shared memory.
- ``gloo``: the same transport broadcasting over gloo on this host's loopback (from a GPU, through host memory).
- ``disk``: a checkpoint written by the trainer and read by the engine.

It imports nothing of the bus or the services, so it runs on a bare GPU machine with torch and transformers:
``python -m loom.bench.weights_colocated --json``. Loom's transformers engine itself serves on CPUs only; the
engine here is what it does with a version, on the device.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from loom.bench.registry import Benchmark
from loom.bench.weights_model import build_model

TRANSPORTS = ("ipc", "gloo", "disk")
TIMEOUT_S = 120.0
BATCH = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    p.add_argument("--repeats", type=int, default=None, help="updates per transport (default 3, quick 2)")
    p.add_argument(
        "--layers", type=int, default=None, help="the model's layers (default 2; 28 are Qwen3-0.6B's)"
    )


def _device(arg: str | None) -> str:
    import torch

    return arg or ("cuda" if torch.cuda.is_available() else "cpu")


def _logits(model: Any, device: str) -> Any:
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor(BATCH, device=device)).logits.float()


def engine_main(device: str, quick: bool, layers: int | None) -> None:
    """The engine's process: each stdin line a version (its number and reference), each stdout line the
    answer once it serves it (the time it took to take, and its logits' sum and a sample)."""
    import copy

    import torch

    from loom.protocol import WeightsRef
    from loom.weights import Incoming

    serving = build_model(quick, seed=0, layers=layers).to(device)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        ref = msgspec.convert(msg["ref"], WeightsRef)
        t0 = time.perf_counter()
        try:
            state = asyncio.run(Incoming(ref, timeout_s=TIMEOUT_S).tensors(device))
            model = copy.deepcopy(serving)
            model.load_state_dict(state, strict=True)
            del state
            logits = _logits(model, device)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # the trainer reports it and goes on with the next transport
            print(json.dumps({"version": msg["version"], "error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        serving = model
        took = time.perf_counter() - t0
        print(json.dumps({"version": msg["version"], "take_s": took, "logits": logits.flatten().tolist()[:4096]}),
              flush=True)  # fmt: skip


def _card(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from loom.weights.collective import Sender
    from loom.weights.publish import transport

    device = _device(args.device)
    repeats = args.repeats or (2 if args.quick else 3)
    root = Path(__file__).resolve().parents[3]
    layers = ["--layers", str(args.layers)] if args.layers else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom.bench.weights_colocated", "--engine", "--device", device, *layers]
        + (["--quick"] if args.quick else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    assert proc.stdin is not None and proc.stdout is not None
    out: dict[str, Any] = {"benchmark": "weights-colocated", "device": device, "card": _card(device)}
    try:
        if json.loads(proc.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError("the engine process did not start")
        with tempfile.TemporaryDirectory(prefix="loom-bench-colocated-") as tmp:
            movers = {
                "ipc": transport("collective", sender=Sender(ipc=True)),
                "gloo": transport("collective", sender=Sender(backend="gloo", ipc=False)),
                "disk": transport("disk", root=tmp),
            }
            version = 0
            results: dict[str, dict[str, Any]] = {}
            for name in TRANSPORTS:
                runs = []
                try:
                    for _ in range(repeats):
                        version += 1
                        model = build_model(args.quick, seed=version, layers=args.layers).to(device)
                        want = _logits(model, device).flatten()[:4096].cpu()
                        runs.append(asyncio.run(_one(movers[name], version, model, proc, want)))
                        del model
                except Exception as e:  # reported; the other transports still run
                    results[name] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"{name}: {results[name]}", file=sys.stderr)
                    continue
                med = statistics.median(r["update_s"] for r in runs)
                out["model_bytes"] = runs[0]["bytes"]
                results[name] = {
                    "update_s": round(med, 4),
                    "bytes_per_s": round(runs[0]["bytes"] / med),
                    "engine_take_s": round(statistics.median(r["take_s"] for r in runs), 4),
                    "logit_max_abs_diff": max(r["diff"] for r in runs),
                    "format": runs[0]["format"],
                    "updates": repeats,
                }
                print(f"{name}: {results[name]}", file=sys.stderr)
            out["transports"] = results
            ok = {k: v["update_s"] for k, v in results.items() if "update_s" in v}
            if "ipc" in ok:
                out["ipc_over_gloo"] = round(ok["gloo"] / ok["ipc"], 2) if "gloo" in ok else None
                out["ipc_over_disk"] = round(ok["disk"] / ok["ipc"], 2) if "disk" in ok else None
    finally:
        proc.stdin.close()
        proc.wait(60)
    return out


async def _one(
    mover: Any, version: int, model: Any, proc: subprocess.Popen[str], want: Any
) -> dict[str, Any]:
    import torch

    from loom.weights.publish import state_of

    assert proc.stdin is not None and proc.stdout is not None
    t0 = time.perf_counter()
    ref = await mover.stage(version, model)
    mine = msgspec.structs.replace(ref, rank=1, world_size=2) if ref.transport == "collective" else ref
    proc.stdin.write(json.dumps({"version": version, "ref": msgspec.to_builtins(mine)}) + "\n")
    proc.stdin.flush()
    try:
        await mover.deliver(ref, TIMEOUT_S)
    finally:
        line = await asyncio.to_thread(proc.stdout.readline)  # the engine answers either way
    took = time.perf_counter() - t0
    if not line:
        raise RuntimeError("the engine process ended")
    answer = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"the engine could not take version {version}: {answer['error']}")
    diff = (torch.tensor(answer["logits"]) - want).abs().max().item()
    last = getattr(mover, "last", None)
    nbytes = sum(t.numel() * t.element_size() for t in state_of(model).values())
    return {"update_s": took, "take_s": answer["take_s"], "diff": diff, "bytes": nbytes,
            "format": last.format if last is not None else ref.transport}  # fmt: skip


BENCHMARK = Benchmark(
    "weights-colocated",
    "moving new weights from a trainer process to an engine process on one device: ipc, gloo, disk",
    add_arguments,
    run,
)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.engine:
        engine_main(_device(a.device), a.quick, a.layers)
    else:
        result = run(a)
        print(json.dumps(result))

"""A trainer process for the co-scheduling demo: a registered RL job running its phases under permits.

Its phases are timed stand-ins for generation and training (``--rollout-s`` and ``--train-s`` scaled by
``--time-scale``); everything around them is the real path: NATS permits through the SDK, warm-start hooks,
progress reports that trigger long-tail migration. It writes what actually ran, as JSON lines, to ``--out``.

    python -m loom_cli.rollmux_trainer --nats URL --job NAME --rollout-s 300 --train-s 100 --out runs.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from loom.protocol import PhasePermit, TailMigration
from loom.runtime import bus
from loom.trainer.phases import PhaseClient

# Share of a rollout's responses done against the share of its time gone: 80% finish in the first half,
# the long tail takes the second (the skewness bubble RollMux's migration reclaims).
STEPS = 20


def done_fraction(time_fraction: float) -> float:
    if time_fraction <= 0.5:
        return 0.8 * time_fraction / 0.5
    return min(1.0, 0.8 + 0.2 * (time_fraction - 0.5) / 0.5)


async def train_job(args: argparse.Namespace) -> list[dict[str, Any]]:
    nc = await bus.connect(args.nats, "loom-rollmux-trainer")  # a user in the URL scopes it (trainer)
    runs: list[dict[str, Any]] = []
    current: dict[str, Any] = {}

    def load(phase: str, permit: PhasePermit) -> None:
        current.update(
            phase=phase, start=time.time(), nodes=permit.nodes, gpus=permit.gpus, group=permit.group
        )

    def offload(phase: str) -> None:
        runs.append({"job": args.job, **current, "end": time.time()})
        current.clear()

    def migrate(m: TailMigration) -> None:
        current.update(migrated_at=m.at, tail_node=m.node, tail_gpus=m.gpus)

    client = PhaseClient(nc, args.job, on_load=load, on_offload=offload, on_migrate=migrate)
    await client.start()
    try:
        for _ in range(args.iterations):
            async with client.phase("rollout", timeout_s=args.wait_s):
                step = args.rollout_s * args.time_scale / STEPS
                for i in range(1, STEPS + 1):
                    await asyncio.sleep(step)
                    await client.progress(done_fraction(i / STEPS))
            async with client.phase("train", timeout_s=args.wait_s):
                await asyncio.sleep(args.train_s * args.time_scale)
    finally:
        await client.close()
        await nc.drain()
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--rollout-s", type=float, required=True)
    p.add_argument("--train-s", type=float, required=True)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.01)
    p.add_argument("--wait-s", type=float, default=120.0, help="longest wait for a permit")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = asyncio.run(train_job(args))
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in runs))


if __name__ == "__main__":
    main()

"""Figures of a finished job, computed from its stored trajectories."""

from __future__ import annotations

from typing import Any

import numpy as np


def summarize(job: dict[str, Any], trajs: list[dict[str, Any]]) -> dict[str, Any]:
    completed = sum(1 for t in trajs if t["status"] == "completed")
    tokens = sum(s["output_len"] for t in trajs for s in t["steps"])
    started = job.get("started_at") or min((t["started_at"] for t in trajs), default=0.0)
    finished = job.get("finished_at") or max((t["finished_at"] for t in trajs), default=started)
    makespan = max(0.0, finished - started)
    lat = np.array([s["gen_s"] * 1000.0 for t in trajs for s in t["steps"]], dtype=float)
    rewards = [t["reward"] for t in trajs if t.get("reward") is not None]
    return {
        "trajectories": job["n_trajectories"],
        "completed": completed,
        "failed": len(trajs) - completed,
        "makespan_s": round(makespan, 3),
        "throughput_tok_s": round(tokens / makespan, 1) if makespan > 0 else 0.0,
        "step_latency_ms": {
            "p50": round(float(np.percentile(lat, 50)), 1) if lat.size else 0.0,
            "p99": round(float(np.percentile(lat, 99)), 1) if lat.size else 0.0,
        },
        "output_tokens": tokens,
        "steps": int(lat.size),
        "mean_reward": round(float(np.mean(rewards)), 4) if rewards else None,
        "workers": sorted({s["worker_id"] for t in trajs for s in t["steps"] if s["worker_id"]}),
    }

"""RollArt's environment experiments (§7.4) in virtual time, on the calibrated engine.

- Trajectory-level vs batch-level interaction: every environment call takes an injected latency drawn from
  N(mu, sigma) (clipped at zero) in place of the recorded one; the same draws feed both modes, so the
  ratio of their rollout times isolates the cost of the per-turn barriers.
- Redundant environment rollouts: a share of environments fail slow (every call ``slow_factor`` times
  longer) or fail stop (hang at a random call). Without redundancy the rollout needs every group: a hung
  environment is detected after ``timeout_s`` and its trajectory rerun from the start on a fresh one. With
  redundancy ``extra`` more groups are launched and the rollout ends when the needed number of groups
  is complete; the rest are aborted.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from loom.bench.harness.cluster import Cluster
from loom.bench.harness.rollout import run_rollout
from loom.protocol import ResolvedPolicy
from loom.workloads.base import Workload, WorkStep, WorkTraj


def with_latency(workload: Workload, mu: float, sigma: float, seed: int) -> Workload:
    """``workload`` with every environment call (not the final answer) taking N(mu, sigma) seconds."""
    rng = random.Random(seed)
    out = Workload(workload.name, workload.source)
    for t in workload.trajectories:
        steps = tuple(
            dataclasses.replace(s, env_s=max(0.0, rng.gauss(mu, sigma)) if k + 1 < len(t.steps) else 0.0)
            for k, s in enumerate(t.steps)
        )
        out.trajectories.append(dataclasses.replace(t, steps=steps))
    return out


def interaction_speedup(
    workload: Workload,
    policy: ResolvedPolicy,
    cluster: Cluster,
    sigma: float,
    mu: float = 10.0,
    seed: int = 0,
) -> dict[str, float]:
    w = with_latency(workload, mu, sigma, seed)
    traj = run_rollout(w, policy, cluster, "none", seed, interaction="trajectory")
    batch = run_rollout(w, policy, cluster, "none", seed, interaction="batch")
    return {
        "trajectory_s": traj.makespan_s,
        "batch_s": batch.makespan_s,
        "speedup": batch.makespan_s / traj.makespan_s if traj.makespan_s else 0.0,
    }


@dataclass(frozen=True)
class Faults:
    slow_share: float = 0.1  # environments that answer ``slow_factor`` times slower
    slow_factor: float = 5.0
    stop_share: float = 0.05  # environments that hang at a random call
    timeout_s: float = 60.0  # how long a hung call takes to be noticed


def _faulty(t: WorkTraj, rng: random.Random, faults: Faults, retry: bool) -> tuple[WorkTraj, bool]:
    """The trajectory as its environment runs it: (what is generated, whether it completes)."""
    steps = list(t.steps)
    u = rng.random()
    if u < faults.slow_share:
        return dataclasses.replace(
            t, steps=tuple(dataclasses.replace(s, env_s=s.env_s * faults.slow_factor) for s in steps)
        ), True
    if u < faults.slow_share + faults.stop_share and len(steps) > 1:
        hang = rng.randrange(len(steps) - 1)  # the call after this step never returns
        head = steps[: hang + 1]
        if not retry:
            return dataclasses.replace(t, steps=tuple(head)), False
        head[-1] = WorkStep(head[-1].input_len, head[-1].output_len, faults.timeout_s)
        return dataclasses.replace(t, steps=(*head, *steps)), True
    return t, True


def redundancy_speedup(
    workload: Workload,
    policy: ResolvedPolicy,
    cluster: Cluster,
    groups: int,
    samples: int,
    extra_groups: int,
    extra_samples: int,
    faults: Faults = Faults(),
    seed: int = 0,
) -> dict[str, float | None]:
    """Time until ``groups`` groups hold ``samples`` finished trajectories each: launching exactly that
    many (hung environments rerun after the timeout), or ``extra_groups`` more groups of ``extra_samples``
    more samples each and stopping at the target. None where the target is never met."""
    by_prompt = workload.by_prompt()
    prompts = [p for p, ts in by_prompt.items() if len(ts) >= samples + extra_samples]
    if len(prompts) < groups + extra_groups:
        raise ValueError(
            f"need {groups + extra_groups} groups of {samples + extra_samples}, the workload has {len(prompts)}"
        )

    def run(n_groups: int, n_samples: int, retry: bool) -> float | None:
        rng = random.Random(seed)  # the same environments misbehave in both runs
        w = Workload(workload.name, workload.source)
        alive: list[bool] = []
        for p in prompts[:n_groups]:
            for t in by_prompt[p][:n_samples]:
                ft, ok = _faulty(t, rng, faults, retry)
                w.trajectories.append(ft)
                alive.append(ok)
        res = run_rollout(w, policy, cluster, "none", seed)
        finished: dict[str, list[float]] = {}
        for t, ok, fin in zip(w.trajectories, alive, res.finish_s, strict=True):
            if ok:
                finished.setdefault(t.prompt, []).append(fin)
        ready = sorted(sorted(f)[samples - 1] for f in finished.values() if len(f) >= samples)
        return float(ready[groups - 1]) if len(ready) >= groups else None

    base = run(groups, samples, retry=True)
    redundant = run(groups + extra_groups, samples + extra_samples, retry=False)
    speedup = base / redundant if base and redundant else None
    return {"baseline_s": base, "redundant_s": redundant, "speedup": speedup}

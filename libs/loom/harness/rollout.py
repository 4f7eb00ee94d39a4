"""One rollout in virtual time: a workload on a simulated cluster under one job policy.

Every trajectory starts with the batch, then alternates LLM calls on its worker's simulated engine (the
calibrated ``SimCore`` the rollout service runs) with its recorded environment time. The policies are
the services' own classes: the queue order becomes the engine priority (with SGLang's preemption for the
preemptive orders), placement is the presorted DP (with migration) or a per-request routing baseline,
and resources are fixed MP or the annealed allocation.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.sim_core import build_core
from loom.engine.virtual import VirtualSim
from loom.harness.bounds import lower_bound
from loom.harness.cluster import Cluster, allocate
from loom.policies.migration import MigrationPlanner
from loom.policies.ordering import Plas
from loom.policies.partition import presorted_dp
from loom.policies.routing import RouterView, make_routing
from loom.predict.history import HistoryPredictor
from loom.protocol import ResolvedPolicy
from loom.workloads.base import Workload, WorkTraj

PREDICTORS = ("oracle", "history", "none")


class _Predictor:
    """Total-length estimates: exact (oracle), per-prompt history, or none (no information)."""

    def __init__(self, kind: str) -> None:
        if kind not in PREDICTORS:
            raise ValueError(f"unknown predictor {kind!r}; one of {PREDICTORS}")
        self.kind = kind
        self.history = HistoryPredictor()

    def total(self, t: WorkTraj, generated: int) -> float:
        if self.kind == "oracle":
            return float(t.output_tokens)
        if self.kind == "history":
            return self.history.predict_total(t.prompt, generated)
        return 0.0

    def finished(self, t: WorkTraj) -> None:
        self.history.observe(t.prompt, t.output_tokens)

    @property
    def discriminates(self) -> bool:
        """Whether its ranks among a group's samples mean anything (see the router's MIGRATING_METHODS)."""
        return self.kind == "oracle"


@dataclass
class RolloutResult:
    makespan_s: float
    output_tokens: int
    throughput_tok_s: float
    lower_bound_s: float
    makespan_over_lb: float
    longest_traj_queueing_s: float
    degrees: list[int]
    migrations: int
    wall_s: float
    finish_s: list[float] = field(repr=False, default_factory=list)
    queueing_s: list[float] = field(repr=False, default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "makespan_s": round(self.makespan_s, 1),
            "throughput_tok_s": round(self.throughput_tok_s, 1),
            "lower_bound_s": round(self.lower_bound_s, 1),
            "makespan_over_lb": round(self.makespan_over_lb, 3),
            "longest_traj_queueing_s": round(self.longest_traj_queueing_s, 1),
            "output_tokens": self.output_tokens,
            "workers": len(self.degrees),
            "degrees": sorted(set(self.degrees), reverse=True),
            "migrations": self.migrations,
            "wall_s": round(self.wall_s, 2),
        }


def run_rollout(
    workload: Workload, policy: ResolvedPolicy, cluster: Cluster, predictor: str = "oracle", seed: int = 0
) -> RolloutResult:
    wall0 = time.perf_counter()
    trajs = workload.trajectories
    n = len(trajs)
    pred = _Predictor(predictor)
    initial = [pred.total(t, 0) for t in trajs]
    degrees = allocate(policy, cluster, initial, seed)
    preemptive = policy.order in ("pps", "autellix")
    sim = VirtualSim()
    engines = [
        sim.add_engine(
            build_core(
                cluster.model,
                cluster.gpu,
                d,
                max_running=cluster.max_running,
                preempt_threshold=10.0 if preemptive else None,
            )
        )
        for d in degrees
    ]
    m = len(engines)
    names = [f"w{i}" for i in range(m)]
    where = [0] * n
    planner: MigrationPlanner | None = None
    routing = None
    if policy.placement == "presorted_dp":
        # Samples of a prompt tie under a prompt-level estimate: the sample-major presort deals them out.
        order = sorted(range(n), key=lambda i: (trajs[i].sample, i))
        profiles = [cluster.profile(d, n) for d in degrees]
        part = presorted_dp([initial[i] for i in order], profiles)
        assignment = part.assignment()
        for rank, i in enumerate(order):
            where[i] = int(assignment[rank])
        if policy.migration and pred.discriminates:
            planner = MigrationPlanner(
                [names[w] for w in part.group_order],
                [part.bounds[w][1] - part.bounds[w][0] for w in part.group_order],
            )
            for i in range(n):
                planner.add(str(i), initial[i], names[where[i]])
    elif policy.placement == "round_robin":
        where = [i % m for i in range(n)]
    else:
        routing = make_routing(policy.placement, names, seed)
    plas = Plas() if policy.order == "autellix" else None

    inflight = [0] * m
    generated = [0] * n
    queued = [0.0] * n
    started = [0.0] * n
    finish = [0.0] * n
    migrations = 0

    def priority(i: int) -> float:
        if policy.order == "pps":
            return max(0.0, pred.total(trajs[i], generated[i]) - generated[i])
        if policy.order == "fcfs":
            return -started[i]
        if plas is not None:
            return -float(plas.level(generated[i]))
        return 0.0

    def start_step(i: int, k: int) -> None:
        t = trajs[i]
        st = t.steps[k]
        if routing is not None:
            w = names.index(
                routing.choose(
                    str(i), st.input_len, RouterView(names, dict(zip(names, inflight, strict=True)))
                )
            )
        else:
            w = where[i]
        inflight[w] += 1
        req = EngineRequest(
            f"{i}.{k}", st.input_len, st.output_len, prefix_key=str(i), ignore_eos=True, priority=priority(i)
        )
        sim.submit(engines[w], req, lambda out: done(i, k, w, out))

    def done(i: int, k: int, w: int, out: EngineOutput) -> None:
        nonlocal migrations
        inflight[w] -= 1
        generated[i] += out.output_len
        queued[i] += out.queue_s
        t = trajs[i]
        if k + 1 == len(t.steps):
            finish[i] = sim.now
            pred.finished(t)
            if planner is not None:
                planner.finish(str(i))
            if routing is not None:
                routing.forget(str(i))
            return
        if planner is not None:
            move = planner.update(str(i), pred.total(t, generated[i]))
            if move is not None:
                dst = names.index(move.dst)
                sim.migrate_prefix(engines[where[i]], engines[dst], str(i))
                where[i] = dst
                planner.moved(str(i), move.dst)
                migrations += 1
        sim.call_at(sim.now + t.steps[k].env_s, lambda: start_step(i, k + 1))

    for i in range(n):
        sim.call_at(0.0, functools.partial(start_step, i, 0))
    sim.run()
    makespan = max(finish) if finish else 0.0
    tokens = sum(generated)
    lb = lower_bound(workload, cluster)
    longest = int(np.argmax([t.output_tokens for t in trajs])) if trajs else 0
    return RolloutResult(
        makespan_s=makespan,
        output_tokens=tokens,
        throughput_tok_s=tokens / makespan if makespan else 0.0,
        lower_bound_s=lb,
        makespan_over_lb=makespan / lb if lb else 0.0,
        longest_traj_queueing_s=queued[longest] if trajs else 0.0,
        degrees=degrees,
        migrations=migrations,
        wall_s=time.perf_counter() - wall0,
        finish_s=finish,
        queueing_s=queued,
    )

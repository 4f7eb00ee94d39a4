"""A lower bound on a rollout's makespan (issue 5): no schedule beats either term.

- The longest trajectory's critical path: every call at batch 1 on the fastest worker the cluster could
  have, its prefill of new context included, plus its environment time; no queueing, no interference.
- All the work at the cluster's peak rate: every worker of the best degree decoding its largest batch
  (its batch limit, or as many typical contexts as its KV cache holds).
"""

from __future__ import annotations

from loom.engine.perf import PerfModel
from loom.harness.cluster import Cluster
from loom.workloads.base import Workload


def critical_path(workload: Workload, cluster: Cluster) -> float:
    best = 0.0
    perfs = [PerfModel(cluster.gpu, cluster.model, d) for d in cluster.degrees_that_fit()]
    for t in workload.trajectories:
        fastest = float("inf")
        for perf in perfs:
            time, context = 0.0, 0
            for s in t.steps:
                new = max(0, s.input_len - context)
                if new:
                    time += perf.iteration_time(new, 0, 0)
                time += s.output_len * perf.per_token_time(1, s.input_len + s.output_len // 2)
                context = s.input_len + s.output_len
            fastest = min(fastest, time)
        best = max(best, fastest + sum(s.env_s for s in t.steps))
    return best


def throughput_bound(workload: Workload, cluster: Cluster) -> float:
    tokens = sum(t.output_tokens for t in workload.trajectories)
    weighted = sum(s.output_len * s.input_len for t in workload.trajectories for s in t.steps)
    context = max(1, int(weighted / max(tokens, 1)))
    peak = 0.0
    for d in cluster.degrees_that_fit():
        perf = PerfModel(cluster.gpu, cluster.model, d)
        batch = max(1, min(cluster.max_running, perf.kv_capacity_tokens() // context))
        peak = max(peak, (cluster.gpus // d) * batch / perf.per_token_time(batch, context))
    return tokens / peak


def lower_bound(workload: Workload, cluster: Cluster) -> float:
    return max(critical_path(workload, cluster), throughput_bound(workload, cluster))

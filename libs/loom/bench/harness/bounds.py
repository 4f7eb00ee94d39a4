"""A lower bound on a rollout's makespan (issue 5): no schedule beats either term.

- The longest trajectory's critical path: every call at batch 1 on the fastest worker the cluster could
  have, its prefill of new context included, plus its environment time between calls; no queueing, no interference.
  Its prompt is prefilled whole in its first call even where another trajectory's prefill of a shared prefix
  spares it that (``EngineRequest.shared_prefix``): someone prefills that prefix before its first call can use
  it, and two prefills take no less than one of both.
- All the work at the cluster's best rate per GPU: every decoded token reading its context, and every
  observation prefilled over the context before it, in as few iterations as the batch limit and the KV
  cache allow, on the best degree. An iteration's time is convex in what it holds (the roofline's max plus
  an exposed share of the sum), so by Jensen no spread of the same work over as many or more iterations is
  faster than the even one. Prompts are left out: a group shares its prompt through the prefix cache, and
  prompts may share a system prompt, so only observations are certainly new to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.bench.harness.cluster import Cluster
from loom.engine.model.perf import PerfModel
from loom.engine.sim.core import Speculation
from loom.workloads.base import Workload, WorkTraj


class Alone:
    """A trajectory alone on one engine of ``perf``: its calls' prefills and decodes (``engine``), and with its
    tool time (``__call__``), no queueing, no interference; a drafting engine's decodes at ``speculation``'s
    rates. Memoised by calls: samples that replay one recorded run (search and tool-use groups beyond their
    recorded trials, coding's ``replay`` siblings) differ only in their tool times."""

    def __init__(self, perf: PerfModel, speculation: Speculation | None = None, decode: bool = True) -> None:
        self.perf = perf
        self.speculation = speculation
        self.decode = decode  # False: prefills only
        self._engine: dict[tuple[tuple[int, int], ...], float] = {}

    def engine(self, t: WorkTraj) -> float:
        s = self._engine.get(t.calls)
        if s is None:
            s = self._engine[t.calls] = _engine_time(self.perf, t.calls, self.decode, self.speculation)
        return s

    def __call__(self, t: WorkTraj) -> float:
        return self.engine(t) + t.tool_s


def critical_path(workload: Workload, cluster: Cluster, speculation: Speculation | None = None) -> float:
    """The longest trajectory alone on its fastest degree; with ``speculation``, on engines that draft at
    those rates (a bound on what any schedule of them achieves)."""
    return _longest_alone(workload, cluster, speculation)


def undraftable(workload: Workload, cluster: Cluster) -> float:
    """The longest trajectory's prefills and environment time alone, on its fastest degree: a floor under the
    makespan that drafting cannot lower, however much it drafts and however cheaply it verifies (it
    shortens decodes only). The plain makespan over it bounds what drafting can buy."""
    return _longest_alone(workload, cluster, decode=False)


def _longest_alone(
    workload: Workload, cluster: Cluster, speculation: Speculation | None = None, decode: bool = True
) -> float:
    alone = [
        Alone(PerfModel(cluster.gpu, cluster.model, d), speculation, decode)
        for d in cluster.degrees_that_fit(workload.max_context)
    ]
    return max((min(a(t) for a in alone) for t in workload.trajectories), default=0.0)


def _engine_time(
    perf: PerfModel,
    calls: tuple[tuple[int, int], ...],
    decode: bool = True,
    speculation: Speculation | None = None,
) -> float:
    """A trajectory's calls ``(input_len, output_len)`` alone on one engine: its prefills and (``decode``) its
    decodes, as verification steps at ``speculation``'s rates if given."""
    positions, per_step = (
        (1.0, 1.0) if speculation is None else (speculation.positions, speculation.tokens_per_step)
    )
    time, context = 0.0, 0
    for input_len, output_len in calls:
        new = max(0, input_len - context)
        if new:
            time += perf.iteration_time(new, 0, 0)
        if decode:
            # The prefill samples token 0; decoding token j reads the input and the j tokens before it.
            time += perf.decode_span(1, input_len + 1, output_len - 1, positions) / per_step
        context = input_len + output_len
    return time


@dataclass(frozen=True)
class Work:
    """What a workload asks of the engines, whatever the schedule."""

    decodes: int  # decode iterations' sequences: every output token but the one each prefill samples
    decode_kv: float  # context tokens those decodes read, summed
    prefill: int  # observation tokens, each prefilled once
    attended: float  # (query, key) pairs of those prefills over the context before them


def work(workload: Workload) -> Work:
    decodes, decode_kv, prefill, attended = 0, 0.0, 0, 0.0
    for t in workload.trajectories:
        context = 0
        for k, s in enumerate(t.steps):
            if k:
                new = max(0, s.input_len - context)
                prefill += new
                attended += new * (s.input_len - new) + new * (new + 1) / 2
            n = max(0, s.output_len - 1)
            decodes += n
            decode_kv += n * s.input_len + n * (n + 1) / 2
            context = s.input_len + s.output_len
    return Work(decodes, decode_kv, prefill, attended)


def throughput_bound(workload: Workload, cluster: Cluster) -> float:
    w = work(workload)
    if not w.decodes and not w.prefill:
        return 0.0
    best = float("inf")
    for d in cluster.degrees_that_fit(workload.max_context):
        perf = PerfModel(cluster.gpu, cluster.model, d)
        iters = max(1.0, w.decodes / cluster.max_running, w.decode_kv / perf.kv_capacity_tokens())
        step = perf.iteration_time(
            w.prefill / iters, w.decodes / iters, w.decode_kv / iters, w.attended / iters
        )
        best = min(best, d * iters * step / cluster.gpus)
    return best


def lower_bound_terms(workload: Workload, cluster: Cluster) -> dict[str, float]:
    """Both terms, by name; the bound is the larger."""
    return {
        "critical_path_s": critical_path(workload, cluster),
        "throughput_s": throughput_bound(workload, cluster),
    }


def lower_bound(workload: Workload, cluster: Cluster) -> float:
    return max(lower_bound_terms(workload, cluster).values())

"""One rollout in virtual time: a workload on a simulated cluster under one job policy.

Every trajectory starts with the batch, then alternates LLM calls on its worker's simulated engine (the
calibrated ``SimCore`` the rollout service runs) with its recorded environment time. The policies are
the services' own classes: the queue order becomes the engine priority (with SGLang's preemption for the
preemptive orders), placement is the presorted DP (with migration) or a per-request routing baseline,
and resources are fixed MP or the annealed allocation.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.bench.harness import served as served_predictor
from loom.bench.harness.bounds import lower_bound_terms
from loom.bench.harness.cluster import Cluster, allocate, tool_time
from loom.bench.harness.learned import Budget, Learned
from loom.bench.harness.served import prompt_key
from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.model.perf import PerfModel
from loom.engine.sim.core import HICACHE_RATIO, Speculation, build_core
from loom.engine.sim.virtual import VirtualSim
from loom.policies.migration import MigrationPlanner
from loom.policies.ordering import Plas, held
from loom.policies.partition import coarsen, presorted_dp
from loom.policies.profiles import placement_weights
from loom.policies.routing import RouterView, make_routing
from loom.predict.blend import SiblingBlend
from loom.predict.combine import Known
from loom.predict.history import HistoryPredictor
from loom.protocol import ResolvedPolicy
from loom.workloads.base import Workload, WorkTraj

# Loom's learned model (cross-fitted, ``loom.bench.harness.learned``) first; the rest are ablations. The
# oracle knows each trajectory exactly (its calls, lengths and what each tool returns) but not a tool's
# latency, a random draw no predictor of the trajectory can know, which it takes at its mean; the
# clairvoyant knows the draws too (an idealisation past any predictor).
PREDICTORS = ("learned", "oracle", "clairvoyant", "history", "none")
EXACT = ("oracle", "clairvoyant")
# The tail is what follows the moment this share of the trajectories has finished.
TAIL_QUANTILE = 0.9


class _Predictor:
    """Total-length estimates: Loom's learned model, exact (oracle, clairvoyant), per-prompt history, or
    none (no information: all equal)."""

    def __init__(self, kind: str, learned: Learned | None = None, workload: str = "") -> None:
        if kind not in PREDICTORS:
            raise ValueError(f"unknown predictor {kind!r}; one of {PREDICTORS}")
        if kind == "learned" and learned is None:
            raise ValueError("the learned predictor needs its predictions (loom.bench.harness.learned)")
        self.kind = kind
        self.learned = learned.totals if learned else {}
        # How far apart two estimates at admission must be to mean anything (0: exact, or all alike).
        self.admission_log_sd = learned.admission_log_sd if learned else 0.0
        self.admission_slope = learned.admission_slope if learned else 1.0
        # The service combines the model's estimates with the group's finished and running samples
        # (``loom.predict.combine``); without combiners, it refines them by the finished samples alone.
        self.served = learned if learned and learned.combiners and kind == "learned" else None
        self.blend = SiblingBlend(learned.admission_log_sd) if learned and self.served is None else None
        self.finished_totals: dict[str, list[float]] = {}  # prompt -> its samples' totals, as they finish
        self.progress: dict[str, dict[str, tuple[int, float]]] = {}  # prompt -> running id -> (calls, tokens)
        self.history = HistoryPredictor()
        self.history_context: dict[str, list[float]] = {}
        self.workload = workload
        # Totals of each prompt's samples at earlier training steps, oldest first (a replay of several steps).
        self.earlier: dict[str, tuple[float, ...]] = {}

    def remember(self, earlier: Mapping[str, Sequence[float]]) -> None:
        """What earlier steps ran of each prompt: the history predictor's statistics and the combiner's
        history (``Known.history``)."""
        for prompt, totals in earlier.items():
            self.earlier[prompt] = tuple(float(x) for x in totals)
            for x in totals:
                self.history.observe(prompt, float(x))

    def total(self, t: WorkTraj, generated: int, calls: int) -> float:
        """The predicted total length once ``calls`` calls have generated ``generated`` tokens."""
        if self.kind in EXACT:
            return float(t.output_tokens)
        if self.served is not None:
            return self.served.combiner(prompt_key(t)).total(self.known(t, generated, calls))
        if self.blend is not None:
            model = float(self.learned[t.id][min(calls, len(t.steps) - 1)])
            return self.blend.total(t.prompt, model, generated)
        if self.kind == "history":
            return self.history.predict_total(t.prompt, generated)
        return 1.0  # no information: every trajectory alike, so placement balances counts

    def known(self, t: WorkTraj, generated: int, calls: int) -> Known:
        """What the predictor service would know of ``t`` now (its own progress is recorded for its
        siblings to read): its group's samples finished so far, in the order they finished, the running
        ones' progress as of their last estimate, and the prompt's totals at earlier steps (``remember``)."""
        group = self.progress.setdefault(t.prompt, {})
        group[t.id] = (calls, float(generated))
        text = self.learned.get(t.id)  # None: a workload of lengths alone
        return Known(
            calls,
            float(generated),
            float(t.steps[0].input_len),
            None if text is None else float(text[min(calls, len(t.steps) - 1)]),
            history=self.earlier.get(t.prompt, ()),
            finished=tuple(self.finished_totals.get(t.prompt, ())),
            running=tuple(v for k, v in group.items() if k != t.id),
            workload=t.task or self.workload,
        )

    def context(self, t: WorkTraj) -> float:
        """The trajectory's mean context while it generates: what it holds of a worker's KV cache."""
        if self.kind in EXACT:
            return mean_context(t)
        if self.kind == "history":
            seen = self.history_context.get(t.prompt)
            if seen:
                return sum(seen) / len(seen)
        return float(t.steps[0].input_len) if t.steps else 1.0

    def prefill(self, t: WorkTraj) -> float:
        """Input tokens the trajectory will prefill: all of them known to the oracle (prompt and every
        observation); otherwise only its prompt, the part known before it runs."""
        if not t.steps:
            return 0.0
        if self.kind not in EXACT:
            return float(t.steps[0].input_len)
        new, context = 0, 0
        for s in t.steps:
            new += max(0, s.input_len - context)
            context = s.input_len + s.output_len
        return float(new)

    def tool(self, t: WorkTraj, cluster: Cluster, total: float) -> float:
        """Seconds the trajectory will spend in tools (every call but the last, whose environment step is
        scoring): known to the clairvoyant, known but each tool latency's draw to the oracle; otherwise
        its predicted calls at the cluster's time per call."""
        if self.kind == "clairvoyant":
            return t.tool_s
        if self.kind == "oracle":
            return t.expected_tool_s
        return tool_time(cluster, total)

    def finished(self, t: WorkTraj) -> None:
        self.finished_totals.setdefault(t.prompt, []).append(float(t.output_tokens))
        self.progress.get(t.prompt, {}).pop(t.id, None)
        self.history_context.setdefault(t.prompt, []).append(mean_context(t))
        self.history.observe(t.prompt, t.output_tokens)
        if self.blend is not None:
            self.blend.observe(t.prompt, t.output_tokens, float(self.learned[t.id][0]))

    @property
    def refines(self) -> bool:
        """Whether a finished sample moves its siblings' estimates."""
        return self.served is not None or self.blend is not None

    @property
    def discriminates(self) -> bool:
        """Whether its ranks among a group's samples mean anything (see the router's MIGRATING_METHODS)."""
        return self.kind in (*EXACT, "learned")


def mean_context(t: WorkTraj) -> float:
    """Context averaged over the trajectory's generated tokens (each step's grows by half its output)."""
    tokens = sum(s.output_len for s in t.steps)
    if not tokens:
        return float(t.steps[0].input_len) if t.steps else 1.0
    return sum(s.output_len * (s.input_len + s.output_len / 2) for s in t.steps) / tokens


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
    breakdown: dict[str, float] = field(default_factory=dict)
    bound_terms: dict[str, float] = field(default_factory=dict)
    cache_hit: float = 0.0
    gantt: list[tuple[int, float, float, int]] = field(repr=False, default_factory=list)
    steps_done: list[tuple[float, int]] = field(repr=False, default_factory=list)
    # The share of output tokens generated on a worker where a sibling of theirs had already started a step:
    # where an engine's drafter holds the group's outputs (its drafting corpus is its own).
    sibling_local_share: float = 0.0
    last_finisher: dict[str, float] = field(default_factory=dict)  # ``_last_finisher``

    @property
    def tail_s(self) -> float:
        """Seconds spent finishing the last 10% of trajectories: the makespan less the moment the first 90%
        had all finished (Seer's long-tail measure)."""
        if not self.finish_s:
            return 0.0
        fin = sorted(self.finish_s)
        return self.makespan_s - fin[math.ceil(TAIL_QUANTILE * len(fin)) - 1]

    @property
    def tail_share(self) -> float:
        return self.tail_s / self.makespan_s if self.makespan_s > 0 else 0.0

    def active_over_time(self, bins: int = 100) -> tuple[list[float], list[int]]:
        """Trajectories not yet finished, sampled at ``bins`` points up to the makespan."""
        ts = np.linspace(0.0, self.makespan_s, bins + 1)
        fin = np.sort(np.asarray(self.finish_s))
        return ts.tolist(), (len(fin) - np.searchsorted(fin, ts, side="right")).tolist()

    def throughput_over_time(self, bins: int = 100) -> tuple[list[float], list[float]]:
        """Generated tokens per second, by step completion, in ``bins`` equal windows (utilisation)."""
        if not self.steps_done or self.makespan_s <= 0:
            return [], []
        edges = np.linspace(0.0, self.makespan_s, bins + 1)
        times, tokens = zip(*self.steps_done, strict=True)
        hist, _ = np.histogram(times, bins=edges, weights=tokens)
        return edges[1:].tolist(), (hist / (edges[1] - edges[0])).tolist()

    def summary(self) -> dict[str, Any]:
        return {
            "makespan_s": round(self.makespan_s, 1),
            "throughput_tok_s": round(self.throughput_tok_s, 1),
            "lower_bound_s": round(self.lower_bound_s, 1),
            "makespan_over_lb": round(self.makespan_over_lb, 3),
            "lower_bound_terms": self.bound_terms,
            "longest_traj_queueing_s": round(self.longest_traj_queueing_s, 1),
            "tail_s": round(self.tail_s, 2),
            "tail_share": round(self.tail_share, 4),
            "output_tokens": self.output_tokens,
            "workers": len(self.degrees),
            "degrees": sorted(set(self.degrees), reverse=True),
            "migrations": self.migrations,
            "cache_hit": round(self.cache_hit, 3),
            "makespan_breakdown": self.breakdown,
            "last_finisher": self.last_finisher,
            "sibling_local_share": round(self.sibling_local_share, 4),
            "wall_s": round(self.wall_s, 2),
        }


INTERACTIONS = ("trajectory", "batch")


def run_rollout(
    workload: Workload,
    policy: ResolvedPolicy,
    cluster: Cluster,
    predictor: str = "oracle",
    seed: int = 0,
    interaction: str = "trajectory",
    gantt_workers: int = 0,
    learned: Learned | None = None,
    speculation: Speculation | None = None,
    earlier: Mapping[str, Sequence[float]] | None = None,
) -> RolloutResult:
    """``interaction``: each trajectory calls its environment as soon as its step is generated
    (trajectory level), or every turn waits for the whole batch to generate and then for every
    environment call to return (batch level, the synchronous agent loop RollArt compares against).
    ``gantt_workers``: record the steps run on the first that many workers, for a Gantt chart.
    ``learned``: the learned predictor's predictions (``loom.bench.harness.learned.cross_fitted``), computed here
    when it is chosen and none are given. ``speculation``: every engine drafts, at these measured rates.
    ``earlier``: each prompt's totals at earlier training steps, oldest first, which the predictors read as
    its history (a replay of a rollout log's steps in order)."""
    if interaction not in INTERACTIONS:
        raise ValueError(f"unknown interaction {interaction!r}; one of {INTERACTIONS}")
    wall0 = time.perf_counter()
    trajs = workload.trajectories
    n = len(trajs)
    if predictor == "learned" and learned is None:
        learned = served_predictor.served(workload, Budget())
    pred = _Predictor(predictor, learned, workload.name)
    pred.remember(earlier or {})
    initial = coarsen([pred.total(t, 0, 0) for t in trajs], pred.admission_log_sd, pred.admission_slope)
    ref, weights = placement_weights([pred.context(t) for t in trajs])
    steps = [st for t in trajs for st in t.steps]
    step_tokens = sum(st.output_len for st in steps) / max(1, len(steps))
    cluster = dataclasses.replace(cluster, context_len=ref, step_tokens=step_tokens)
    prefill = [pred.prefill(t) for t in trajs]
    tools = [pred.tool(t, cluster, p) for t, p in zip(trajs, initial, strict=True)]
    degrees = allocate(
        policy, cluster, initial, seed, weights, prefill, tools, pred.admission_log_sd, workload.max_context
    )
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
                evict_by_priority=policy.priority_cache,
                hicache_ratio=HICACHE_RATIO if policy.host_cache else 0.0,
                speculation=speculation,
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
        top = int(np.ceil(sum(weights))) + 1
        profiles = [cluster.profile(d, top) for d in degrees]
        part = presorted_dp(
            [initial[i] for i in order],
            profiles,
            weights=[weights[i] for i in order],
            prefill=[prefill[i] for i in order],
            tool=[tools[i] for i in order],
            # Predictions with an error: of the placements they cannot tell from the optimum, the least
            # packed (``_spread``).
            spread=pred.admission_log_sd > 0,
            slack=math.exp(pred.admission_log_sd),
        )
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
    calls = [0] * n
    queued = [0.0] * n
    prefill_s = [0.0] * n
    decode_s = [0.0] * n
    cached = 0
    gantt: list[tuple[int, float, float, int]] = []  # (worker, start, end, trajectory) per step
    steps_done: list[tuple[float, int]] = []  # (time, tokens) per finished step
    first_priority = [0.0] * n  # what each trajectory's first call was ranked by in its engine's queue
    first_queue = [0.0] * n  # seconds its first call waited
    finish = [0.0] * n
    last_worker = [0] * n  # where each trajectory ran its last step (routing moves it every step)
    migrations = 0
    pending: dict[int, tuple[int, str]] = {}  # trajectory -> (worker, rid) of its call in flight
    siblings: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        siblings.setdefault(t.prompt, []).append(i)
    shared = workload.shared_prefixes()
    served: list[dict[str, set[int]]] = [collections.defaultdict(set) for _ in range(m)]
    sibling_local = 0

    ranked: dict[int, float] = {}  # PPS: each trajectory's priority so far (``held``, as the router keeps it)

    def priority(i: int) -> float:
        if policy.order == "pps":
            # Algorithm 1, line 3: the predicted length.
            ranked[i] = held(ranked.get(i), pred.total(trajs[i], generated[i], calls[i]))
            return ranked[i]
        if policy.order == "fcfs":
            # Trajectory-level FCFS: the place of its first request (the router's traj_arrival), which is its
            # index, every first request being submitted at time 0 in index order (below); a trajectory back
            # from its tool keeps that place, where round robin sends it to the back.
            return -float(i)
        if plas is not None:
            return -float(plas.level(generated[i]))
        return 0.0

    def start_step(i: int, k: int) -> None:
        nonlocal sibling_local
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
        group_here = served[w][t.prompt]
        sibling_local += st.output_len if group_here - {i} else 0
        group_here.add(i)
        inflight[w] += 1
        req = EngineRequest(
            f"{i}.{k}",
            st.input_len,
            st.output_len,
            prefix_key=str(i),
            ignore_eos=True,
            priority=priority(i),
            shared_prefix=shared[t.id],
        )
        if k == 0:
            first_priority[i] = req.priority
        pending[i] = (w, req.rid)
        sim.submit(engines[w], req, lambda out: done(i, k, w, out))

    def done(i: int, k: int, w: int, out: EngineOutput) -> None:
        finished_step(i, k, w, out)
        if gantt_workers and w < gantt_workers:
            # Clamped: the engine's time parts sum back to the submission up to rounding.
            gantt.append((w, max(0.0, sim.now - out.queue_s - out.prefill_s - out.decode_s), sim.now, i))
        steps_done.append((sim.now, out.output_len))
        on_idle()

    def finished_step(i: int, k: int, w: int, out: EngineOutput) -> None:
        nonlocal cached
        inflight[w] -= 1
        generated[i] += out.output_len
        calls[i] += 1
        queued[i] += out.queue_s
        if k == 0:
            first_queue[i] = out.queue_s
        prefill_s[i] += out.prefill_s
        decode_s[i] += out.decode_s
        cached += out.cached_tokens
        t = trajs[i]
        pending.pop(i, None)
        if k + 1 == len(t.steps):
            finish[i] = sim.now
            last_worker[i] = w
            sim.end_prefix(engines[w], str(i))
            pred.finished(t)
            if pred.refines:
                # A finished sample moves its siblings' estimates (the predictor service publishes them):
                # their waiting requests are re-keyed and the migration planner sees them.
                for j in siblings[t.prompt]:
                    if finish[j] or j == i:
                        continue
                    if j in pending and policy.order == "pps":
                        sim.reprioritize(engines[pending[j][0]], pending[j][1], priority(j))
                    replan(j)
            if planner is not None:
                planner.finish(str(i))
            if routing is not None:
                routing.forget(str(i))
            return
        replan(i)
        if interaction == "trajectory":
            sim.call_at(sim.now + t.steps[k].env_s, lambda: start_step(i, k + 1))
        else:
            turn.append((i, k))

    def replan(i: int) -> None:
        """The planner sees the trajectory's new estimate; its next step runs where a move sends it."""
        nonlocal migrations
        if planner is None:
            return
        move = planner.update(str(i), pred.total(trajs[i], generated[i], calls[i]))
        if move is not None:
            dst = names.index(move.dst)
            sim.migrate_prefix(engines[where[i]], engines[dst], str(i))
            where[i] = dst
            planner.moved(str(i), move.dst)
            migrations += 1

    # Batch level: the turn ends when its last generation does, then every environment call runs and the
    # next turn starts when the last of them returns.
    turn: list[tuple[int, int]] = []

    def next_turn() -> None:
        if not turn:
            return
        ready = list(turn)
        turn.clear()
        barrier = sim.now + max(trajs[i].steps[k].env_s for i, k in ready)
        for i, k in ready:
            sim.call_at(barrier, functools.partial(start_step, i, k + 1))

    def on_idle() -> None:
        if interaction == "batch" and not any(inflight):
            next_turn()

    for i in range(n):
        sim.call_at(0.0, functools.partial(start_step, i, 0))
    sim.run()
    makespan = max(finish) if finish else 0.0
    last = int(np.argmax(finish)) if trajs else 0
    inputs = sum(st.input_len for t in trajs for st in t.steps)
    tokens = sum(generated)
    bound_terms = lower_bound_terms(workload, cluster)
    lb = max(bound_terms.values())
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
        breakdown=_formula1(
            trajs[last], cluster, degrees[last_worker[last]], queued[last], prefill_s[last] + decode_s[last]
        )
        if trajs
        else {},
        bound_terms={k: round(v, 1) for k, v in bound_terms.items()},
        cache_hit=cached / inputs if inputs else 0.0,
        gantt=gantt,
        steps_done=steps_done,
        sibling_local_share=sibling_local / tokens if tokens else 0.0,
        last_finisher=_last_finisher(last, trajs, first_priority, first_queue, queued) if trajs else {},
    )


def _last_finisher(
    last: int,
    trajs: Sequence[WorkTraj],
    first_priority: Sequence[float],
    first_queue: Sequence[float],
    queued: Sequence[float],
) -> dict[str, float]:
    """Why the trajectory that set the makespan finished last: how many trajectories were longer, how many
    its first call was ranked below in the engines' queues (under an exact predictor, the longer ones; under
    one that cannot rank, more), and how long that first call waited of all its queueing."""
    tokens, prio = trajs[last].output_tokens, first_priority[last]
    return {
        "longer": sum(t.output_tokens > tokens for t in trajs),
        "ranked_above": sum(p > prio for p in first_priority),
        "first_call_queueing_s": round(first_queue[last], 1),
        "queueing_s": round(queued[last], 1),
    }


def _formula1(
    t: WorkTraj, cluster: Cluster, degree: int, queue_s: float, engine_s: float
) -> dict[str, float]:
    """Heddle Formula 1 for the trajectory that finished last (it sets the makespan): its queueing, its
    tokens at the base per-token time T (batch 1, its own context, its worker's degree), the interference
    on top of that (sharing the batch, prefills, re-prefills after eviction), and its tool time."""
    perf = PerfModel(cluster.gpu, cluster.model, degree)
    base = sum(st.output_len * perf.per_token_time(1, st.input_len + st.output_len // 2) for st in t.steps)
    return {
        "queueing_s": round(queue_s, 1),
        "base_s": round(base, 1),
        "interference_s": round(max(0.0, engine_s - base), 1),
        "tool_s": round(t.tool_s, 1),
    }

"""Many RL jobs on a disaggregated cluster, in virtual time, under a co-scheduling policy (RollMux §7.5).

Arrivals come from a cluster trace (Alibaba's openb pod list: creation times; durations from its deletion
times or Microsoft Philly's runtimes) or a Poisson process. A job's trace duration is its solo runtime,
and in a group it runs one iteration per meta-iteration, which changes whenever the group gains or loses
a member. Cost is integrated over time; a job meets its SLO when its mean iteration over its whole run is
within ``SLO x T_solo``.
"""

from __future__ import annotations

import csv
import heapq
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.intergroup import CoScheduler, Policy, RollMux
from loom.policies.rollmux.job import RLJob, sample_job
from loom.policies.rollmux.roundrobin import ROLLOUT, TRAIN, Permit, Phase, RoundRobinExecutor
from loom.settings import default_shared_dir


class ClusterTraceError(ValueError):
    pass


@dataclass(frozen=True)
class Arrival:
    t: float
    job: RLJob
    duration: float  # solo runtime (s)


def cluster_dir() -> Path:
    return default_shared_dir() / "data" / "cluster"


def openb_pods(path: Path | None = None) -> list[tuple[float, float]]:
    """(creation, deletion) of the GPU pods of the openb trace (num_gpu >= 1), in creation order."""
    p = path or cluster_dir() / "openb_pod_list_default.csv"
    if not p.exists():
        raise ClusterTraceError(f"cluster trace not found: {p} (expected ../shared/data beside the project)")
    with p.open(newline="") as f:
        rows = [
            (float(r["creation_time"]), float(r["deletion_time"]))
            for r in csv.DictReader(f)
            if int(r["num_gpu"] or 0) >= 1 and r["deletion_time"]
        ]
    return sorted(rows)


def philly_runtimes(path: Path | None = None, min_s: float = 3600.0) -> list[float]:
    """Philly job runtimes (s) of at least ``min_s``: shorter ones are mostly failed or debugging runs, not
    RL post-training jobs; the rest average about 16 h (the paper's Philly segment: 14.4 h)."""
    p = path or cluster_dir() / "philly_runtime.csv"
    if not p.exists():
        raise ClusterTraceError(f"cluster trace not found: {p} (expected ../shared/data beside the project)")
    with p.open() as f:
        next(f)
        out = [float(x) for x in f if x.strip() and float(x) >= min_s]
    if not out:
        raise ClusterTraceError(f"no runtimes of at least {min_s} s in {p}")
    return out


def make_arrivals(
    n: int,
    rng: random.Random,
    *,
    workload: str = "mixed",
    arrivals: str = "openb",
    durations: str = "philly",
    offset: int = 1000,
    rate_per_h: float = 2.0,
    slo: float | tuple[float, float] = (1.0, 2.0),
) -> list[Arrival]:
    """``n`` jobs of a Table 6 workload: arrival times from the openb trace (a window of ``n`` consecutive
    GPU pods from ``offset``) or Poisson; durations from Philly or from the openb pods' lifetimes."""
    pods = openb_pods() if arrivals == "openb" or durations == "openb" else []
    if arrivals == "openb":
        window = pods[offset : offset + n]
        if len(window) < n:
            raise ClusterTraceError(f"the openb trace has {len(pods)} GPU pods; {offset}+{n} asked for")
        t0 = window[0][0]
        times = [c - t0 for c, _ in window]
    elif arrivals == "poisson":
        t, times = 0.0, []
        for _ in range(n):
            times.append(t)
            t += rng.expovariate(rate_per_h / 3600.0)
    else:
        raise ClusterTraceError(f"arrivals must be openb or poisson, not {arrivals!r}")
    if durations == "philly":
        runtimes = philly_runtimes()
        lengths = [rng.choice(runtimes) for _ in range(n)]
    elif durations == "openb":
        lengths = [d - c for c, d in pods[offset : offset + n]]
    else:
        raise ClusterTraceError(f"durations must be philly or openb, not {durations!r}")
    out = []
    for i, (t, d) in enumerate(zip(times, lengths, strict=True)):
        job = sample_job(f"job-{i:04d}", workload, rng, slo)
        out.append(Arrival(t, job, max(d, job.t_solo)))  # at least one iteration
    return out


@dataclass
class _Progress:
    arrival: float
    iterations: float  # the solo run's iterations: what the "iterations" model makes a job finish
    done: float  # iterations run so far
    since: float
    period: float
    version: int = 0


@dataclass
class Outcome:
    policy: str
    dollars: float = 0.0
    peak_cost: float = 0.0
    met: int = 0
    jobs: int = 0
    end: float = 0.0
    slowdowns: list[float] = field(default_factory=list)  # mean iteration over solo, per job
    # (time s, $/h, rollout GPUs, training GPUs) after every event
    timeline: list[tuple[float, float, int, int]] = field(default_factory=list)

    @property
    def slo_attainment(self) -> float:
        return self.met / self.jobs if self.jobs else 1.0

    def cost_per_hour(self, horizon_s: float) -> float:
        return self.dollars / (horizon_s / 3600.0)


MODELS = ("duration", "iterations")


def simulate(
    arrivals: Sequence[Arrival], cluster: ClusterSpec, policy: Policy, model: str = "duration"
) -> Outcome:
    """Run the arrivals through ``policy``.

    ``model="duration"`` (the paper's replay: the trace dictates arrival times and durations): a job stays
    for its trace duration and completes as many iterations as its group's meta-iterations allow.
    ``model="iterations"``: a job needs ``duration / T_solo`` iterations, so a slowdown keeps it, and its
    nodes, longer.
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, not {model!r}")
    state = CoScheduler(cluster, policy)
    out = Outcome(policy.name, jobs=len(arrivals))
    jobs: dict[str, _Progress] = {}
    solo = {a.job.id: a.job for a in arrivals}
    events: list[tuple[float, int, str, object]] = [(a.t, i, "arrive", a) for i, a in enumerate(arrivals)]
    heapq.heapify(events)
    seq = len(arrivals)
    now = arrivals[0].t if arrivals else 0.0
    cost = 0.0

    def push(t: float, what: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, what, payload))

    def regroup(gid: int, t: float) -> None:
        g = state.groups.get(gid)
        if g is None:
            return
        period = g.period()
        for jid in g.members:
            p = jobs[jid]
            p.done += (t - p.since) / p.period
            p.since, p.period = t, period
            if model == "iterations":
                p.version += 1
                push(t + max(p.iterations - p.done, 0.0) * period, "finish", (jid, p.version))

    while events:
        t, _, kind, payload = heapq.heappop(events)
        jid, version = "", 0
        if kind == "finish":
            jid, version = payload  # type: ignore[misc]
            if jid not in jobs or jobs[jid].version != version:
                continue
        out.dollars += cost * (t - now) / 3600.0
        now = t
        if kind == "arrive":
            a: Arrival = payload  # type: ignore[assignment]
            d = state.submit(a.job)
            jobs[a.job.id] = _Progress(t, a.duration / a.job.t_solo, 0.0, t, d.period)
            if model == "duration":
                push(t + a.duration, "finish", (a.job.id, 0))
            regroup(state.where[a.job.id], t)
        else:
            p = jobs.pop(jid)
            p.done += (t - p.since) / p.period
            mean_iteration = (t - p.arrival) / p.done
            out.slowdowns.append(mean_iteration / solo[jid].t_solo)
            out.met += mean_iteration <= solo[jid].budget * (1 + 1e-9)
            regroup(state.depart(jid).id, t)
        cost = state.cost()
        out.peak_cost = max(out.peak_cost, cost)
        out.timeline.append((t, cost, *state.gpus()))
    out.end = now
    return out


def decision_latency(cluster: ClusterSpec, n_jobs: int, seed: int = 0, samples: int = 20) -> dict[str, float]:
    """Milliseconds for RollMux to place one more job among ``n_jobs`` resident ones (paper Table 5)."""
    rng = random.Random(seed)
    state = CoScheduler(cluster, RollMux())
    for i in range(n_jobs):
        state.submit(sample_job(f"r{i}", "mixed", rng))
    times = []
    for i in range(samples):
        job = sample_job(f"x{i}", "mixed", rng)
        t0 = time.perf_counter()
        state.policy.place(state, job)
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median_ms": statistics.median(times),
        "max_ms": max(times),
        "groups": len(state.groups),
        "unsaturated": sum(not g.saturated() for g in state.groups.values()),
    }


def execute_group(
    phases: Sequence[Phase], iterations: int
) -> list[tuple[int, str, tuple[int, ...], float, float]]:
    """Run the live round-robin executor in virtual time with fixed phase durations.

    Every job asks for its rollout, then its training, ``iterations`` times; returns the executed phases as
    (job index, phase, resources, start, end).
    """
    ex = RoundRobinExecutor()
    for k, p in enumerate(phases):
        ex.add(str(k), p.nodes)
    left = {str(k): iterations for k in range(len(phases))}
    running: list[tuple[float, int, str, str]] = []
    ran: list[tuple[int, str, tuple[int, ...], float, float]] = []
    now, seq = 0.0, 0

    def start(permits: list[Permit], t: float) -> None:
        nonlocal seq
        for pm in permits:
            k = int(pm.job)
            dur = phases[k].roll if pm.phase == ROLLOUT else phases[k].train
            seq += 1
            heapq.heappush(running, (t + dur, seq, pm.job, pm.phase))
            ran.append((k, pm.phase, pm.nodes, t, t + dur))

    for k in range(len(phases)):
        start(ex.request(str(k), ROLLOUT), now)
    while running:
        now, _, job, phase = heapq.heappop(running)
        granted = ex.done(job, phase)
        if phase == ROLLOUT:
            granted += ex.request(job, TRAIN)
        else:
            left[job] -= 1
            if left[job]:
                granted += ex.request(job, ROLLOUT)
        start(granted, now)
    return ran

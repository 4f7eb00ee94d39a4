"""Whole RL training steps in virtual time: a rollout fleet of simulated engines feeding a trainer.

The loop is the live one (``services/scheduler/streams.py`` with ``loom.trainer``), on the virtual clock and
with the same rules from ``loom.policies.staleness``: groups start from the data set while the buffer has
room and the bound would still admit them when the trainer can next take them; the trainer takes the first
``batch_groups`` complete groups the bound admits (stale ones are dropped and their prompts sampled again),
trains (``TrainStage``: the tokens it trains, at the calibrated MFU), then moves the fleet to the new weights:
the engines pause for the transfer (RollArt Table 3) and commit, running requests recomputing their KV
(``SimCore.commit_weights``), and the trajectories the bound no longer admits are aborted with their
groups, which start again. Three modes are settings of those rules:

- ``sync`` (veRL): bound 0, one batch in flight; rollout waits while the batch trains.
- ``one-off`` (StreamRL): bound 1, one batch in flight: the next batch generates while this one trains.
- ``async`` (RollArt §5.3): bound alpha, ``1 + alpha`` batches in flight, so the batch is the first groups
  to finish and long groups land in a later one, up to alpha versions late. In RollArt's workflow (§4.4:
  get_batch, suspend, model_update, resume, train_step) the fleet receives the previous update's weights
  when the trainer takes a batch, not when the update is made: while a batch trains the fleet generates one
  version behind the trainer, and a group started then may still be taken two batches later. The bound is
  counted on the fleet's version, as RollArt counts it, so bound alpha trains on data up to alpha + 1
  updates behind the policy being trained (``policy_lag_max``). ``async-N-eager`` pushes each update as soon
  as it is made (as veRL and ``loom train`` do): the bound then counts from the trainer's own policy.

A trajectory runs all its calls on one engine (its prefix cache stays there), chosen when it starts: of the
engines its task's hardware affinity allows, the one with the least predicted work, each trajectory there
counted at the mean output of the finished trajectories of its task (``HistoryPredictor`` keyed by the
task's tag). Counting trajectories instead puts a batch's groups round the engines in the order they
start, so an interleaved mix stacks every coding group on the same few engines (a third of the engines
ran all the coding agents of a 72-engine fleet), a tail no scheduler that knows the task would leave.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom.bench.harness.bounds import Alone
from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.model.perf import PerfModel, gpu_spec, model_config
from loom.engine.model.train_perf import TrainStage, weight_sync_s
from loom.engine.sim.core import build_core
from loom.engine.sim.virtual import VirtualSim
from loom.policies.affinity import eligible
from loom.policies.staleness import AsyncBound, groups_to_start, task_at
from loom.predict.history import HistoryPredictor
from loom.workloads.base import Workload, WorkTraj


@dataclass(frozen=True)
class Pool:
    """Rollout engines of one GPU type: ``gpus`` GPUs as engines of ``tp`` each. ``link`` carries the weights
    from the trainer: ``rdma`` within the training cluster, ``tcp`` across clusters."""

    gpu: str
    gpus: int
    tp: int = 1
    link: str = "rdma"
    # The weights come from a checkpoint on a shared filesystem at this rate instead (``loom bench weights``'s
    # disk transport), written and read in the pause; None: over ``link`` at RollArt Table 3's rate.
    disk_bytes_per_s: float | None = None

    def sync_s(self, model: str) -> float:
        """Seconds the new weights take to reach an engine of this pool."""
        if self.disk_bytes_per_s is None:
            return weight_sync_s(model, self.link)
        return model_config(model).weight_bytes / self.disk_bytes_per_s


@dataclass(frozen=True)
class Mode:
    name: str
    alpha: int
    batches_in_flight: int
    # RollArt §5.2: engines across clusters (``tcp`` pools) fetch the new weights from the store on their
    # own and pause only for the local load; the trainer and the ``rdma`` pools do not wait for them. Under
    # a bound of 1 or more they keep generating while they fetch; under bound 0 they hold new work until
    # their weights land (nothing may generate under old ones), while the near pools already run it.
    # Otherwise every engine pauses until the slowest link has delivered them (veRL's broadcast).
    async_update: bool = False
    # RollArt §4.4's workflow: get_batch, suspend, model_update (the weights the previous train_step made),
    # resume, train_step. The fleet moves to new weights when the trainer takes its next batch, so it runs
    # one version behind the trainer while the batch trains, and the bound, counted on the fleet's version
    # as RollArt counts it, admits data up to alpha + 1 updates older than the policy being trained.
    # Otherwise the trainer pushes each update as soon as it is made (veRL, StreamRL, ``loom train``).
    update_at_take: bool = False

    def with_async_update(self) -> Mode:
        return dataclasses.replace(self, name=f"{self.name}+async-update", async_update=True)

    @staticmethod
    def sync() -> Mode:
        return Mode("sync", 0, 1)

    @staticmethod
    def one_off() -> Mode:
        return Mode("one-off", 1, 1)

    @staticmethod
    def asynchronous(alpha: int, at_take: bool = True) -> Mode:
        """RollArt's loop at bound alpha; ``at_take=False`` pushes each update as soon as it is made (the
        bound then counts from the trainer's own policy: one update stricter than RollArt's)."""
        if alpha < 1:
            # Updating at the take under bound 0 would also deadlock: nothing may start while the first batch
            # trains, and with no update made yet the fleet's version cannot move.
            raise ValueError("the asynchronous mode needs a bound of at least 1 (0 is sync)")
        return Mode(
            f"async-{alpha}" + ("" if at_take else "-eager"), alpha, 1 + alpha, update_at_take=at_take
        )


@dataclass
class _Group:
    gid: int
    pos: int
    members: list[WorkTraj]
    start_version: int
    left: int  # members not yet finished: the group is complete at 0
    live: bool = True
    # Per member: its engine, the rid of its call in flight ("" between calls), calls finished, and whether
    # it is done.
    engine: list[int] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)  # output tokens, counted on its engine's work
    rid: list[str] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)


@dataclass
class TrainingResult:
    mode: str
    steps: int
    step_time_s: float  # mean over the measured steps (after the warm-up)
    step_ends_s: list[float]
    train_s: float  # mean update time per step
    sync_s: float  # per step, until the first engine can generate under the new weights
    wait_s: float  # mean time the trainer waited for a batch per step
    # Mean over the measured steps of the slowest trajectory of the batch alone on its engine (calls and
    # tool time): the part of the wait no placement or scheduling can remove.
    tail_floor_s: float
    aborted_fraction: float  # aborted trajectories over trajectories started
    aborted_tokens: int
    trained_tokens: float  # mean per step
    batch_mix: dict[str, float]  # share of each task's trajectories in the measured batches
    staleness_mean: float
    staleness_max: int  # over every trained batch, warm-up included: against the fleet's version
    # Updates between the policy a batch trains and the one that started its oldest trajectory (the
    # staleness above plus the trainer's lead), over every trained batch.
    policy_lag_max: int
    wall_s: float
    per_step: list[dict[str, float]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "step_time_s": round(self.step_time_s, 1),
            "train_s": round(self.train_s, 1),
            "sync_s": round(self.sync_s, 1),
            "wait_s": round(self.wait_s, 1),
            "tail_floor_s": round(self.tail_floor_s, 1),
            "aborted_fraction": round(self.aborted_fraction, 3),
            "staleness_mean": round(self.staleness_mean, 2),
            "policy_lag_max": self.policy_lag_max,
            "trained_tokens": round(self.trained_tokens),
            "batch_mix": {k: round(v, 3) for k, v in self.batch_mix.items()},
            "wall_s": round(self.wall_s, 2),
        }


def local_load_s(model: str, pool: Pool) -> float:
    """Seconds for an engine to load fetched weights from host memory onto its GPUs (each its shard, over
    its own host link)."""
    shard = model_config(model).weight_bytes / pool.tp
    return shard / (gpu_spec(pool.gpu).host_link_gbps * 1e9)


def run_training(
    workload: Workload,
    model: str,
    pools: list[Pool],
    train: TrainStage,
    mode: Mode,
    batch_groups: int,
    steps: int,
    warmup: int = 1,
    max_running: int = 256,
    seed: int = 0,
    affinity: Mapping[str, str] | None = None,
) -> TrainingResult:
    """Run ``steps`` training steps of ``model`` and time the ones after ``warmup``; ``affinity`` maps task
    tags to the GPU types of the pools that may run them (``loom.policies.affinity``)."""
    if steps <= warmup:
        raise ValueError(f"need more steps ({steps}) than warm-up steps ({warmup})")
    wall0 = time.perf_counter()
    data = list(workload.by_prompt().values())
    shared = workload.shared_prefixes()
    if len(data) < batch_groups:
        raise ValueError(f"{len(data)} groups in the workload, fewer than a batch of {batch_groups}")
    sim = VirtualSim()
    engines: list[int] = []
    pool_of: list[int] = []  # per engine
    for i, p in enumerate(pools):
        for _ in range(p.gpus // p.tp):
            engines.append(sim.add_engine(build_core(model, p.gpu, p.tp, max_running=max_running)))
            pool_of.append(i)
    alone = [Alone(PerfModel(p.gpu, model, p.tp)) for p in pools]
    gpu_of = [pools[i].gpu for i in pool_of]
    where = {
        tag: np.array(eligible(gpu_of, affinity, tag)) for tag in {t.task for t in workload.trajectories}
    }
    if not engines:
        raise ValueError("no rollout engines")
    far_pool = [mode.async_update and p.link == "tcp" for p in pools]
    far = [e for e, i in zip(engines, pool_of, strict=True) if far_pool[i]]
    near = [e for e, i in zip(engines, pool_of, strict=True) if not far_pool[i]]
    pause_s = max((pools[pool_of[e]].sync_s(model) for e in near), default=0.0)
    fetch_s = weight_sync_s(model, "tcp")
    load_s = max((local_load_s(model, p) for p in pools if p.link == "tcp"), default=0.0)
    # What the update holds up: the near pools' pause, or with none, the far pools' fetch where bound 0
    # holds their work until it lands (under a bound they generate on meanwhile).
    exposed_s = pause_s if near else (fetch_s + load_s if mode.alpha == 0 else 0.0)
    bound = AsyncBound(mode.alpha)
    limit = batch_groups * mode.batches_in_flight
    history = HistoryPredictor()  # keyed by task tag
    work = np.zeros(len(engines))  # predicted output tokens of the trajectories on each engine

    version, consumed = 0, -1
    trained = 0  # updates the trainer has made; the fleet serves ``version`` of them
    next_pos = 0
    retry: deque[int] = deque()
    groups: dict[int, _Group] = {}  # started and not yet taken: what back-pressure counts
    buffer: list[int] = []  # complete groups waiting for the trainer, in completion order
    started = aborted = aborted_tokens = 0
    gids = iter(range(1 << 62))
    trainer_busy = False
    waiting_since = 0.0
    ends: list[float] = []
    per_step: list[dict[str, float]] = []

    def refill() -> None:
        nonlocal next_pos
        if not bound.may_start(version, consumed):
            return
        for _ in range(groups_to_start(len(groups), limit, None)):
            if retry:
                pos = retry.popleft()
            else:
                pos, next_pos = next_pos, next_pos + 1
            members = data[task_at(pos, len(data), False, seed)]
            g = _Group(next(gids), pos, members, version, len(members))
            groups[g.gid] = g
            for j, t in enumerate(members):
                mine = where[t.task]
                w = int(mine[np.argmin(work[mine])])
                g.predicted.append(history.predict_total(t.task, 0))
                work[w] += g.predicted[j]
                g.engine.append(w)
                g.rid.append("")
                g.calls.append(0)
                g.done.append(False)
                submit(g, j)

    def submit(g: _Group, j: int) -> None:
        nonlocal started
        if not g.live:
            return
        k = g.calls[j]
        started += k == 0
        st = g.members[j].steps[k]
        g.rid[j] = f"{g.gid}.{j}.{k}"
        req = EngineRequest(
            g.rid[j],
            st.input_len,
            st.output_len,
            prefix_key=f"{g.gid}.{j}",
            ignore_eos=True,
            shared_prefix=shared[g.members[j].id],
        )
        sim.submit(engines[g.engine[j]], req, functools.partial(step_done, g, j))

    def step_done(g: _Group, j: int, out: EngineOutput) -> None:
        if not g.live:
            return
        g.rid[j] = ""
        g.calls[j] += 1
        t = g.members[j]
        if g.calls[j] < len(t.steps):
            sim.call_at(sim.now + t.steps[g.calls[j] - 1].env_s, functools.partial(submit, g, j))
            return
        g.done[j] = True
        work[g.engine[j]] -= g.predicted[j]
        history.observe(t.task, sum(st.output_len for st in t.steps))
        sim.end_prefix(engines[g.engine[j]], f"{g.gid}.{j}")
        g.left -= 1
        if g.left == 0:
            buffer.append(g.gid)
            take()

    def drop(g: _Group) -> None:
        """A group the bound no longer admits: abort its calls in flight, free its engines' slots, and sample
        its prompt again. Every trajectory of it is wasted, finished or not."""
        nonlocal aborted, aborted_tokens
        g.live = False
        for j, t in enumerate(g.members):
            if g.rid[j]:
                sim.abort(engines[g.engine[j]], g.rid[j])
            if not g.done[j]:
                work[g.engine[j]] -= g.predicted[j]
                sim.end_prefix(engines[g.engine[j]], f"{g.gid}.{j}")
            aborted += 1
            aborted_tokens += sum(st.output_len for st in t.steps[: g.calls[j]])
        retry.append(g.pos)
        del groups[g.gid]

    def take() -> None:
        nonlocal trainer_busy, consumed
        if trainer_busy:
            return
        stale = [gid for gid in buffer if not bound.admits(groups[gid].start_version, version)]
        for gid in stale:
            buffer.remove(gid)
            drop(groups[gid])
        if len(buffer) < batch_groups:
            if stale:
                refill()
            return
        batch = [groups.pop(gid) for gid in buffer[:batch_groups]]
        del buffer[:batch_groups]
        consumed = version
        trainer_busy = True
        contexts = [t.final_context for g in batch for t in g.members]
        train_s = train.step_s(contexts)
        tasks: dict[str, float] = {}
        for g in batch:
            for t in g.members:
                tasks[t.task] = tasks.get(t.task, 0.0) + 1
        per_step.append(
            {
                **{f"task:{k}": v for k, v in tasks.items()},
                "wait_s": sim.now - waiting_since,
                "train_s": train_s,
                "tokens": float(sum(contexts)),
                "staleness": float(np.mean([version - g.start_version for g in batch])),
                "staleness_max": float(max(version - g.start_version for g in batch)),
                "lag_max": float(max(trained - g.start_version for g in batch)),
                "trajectories": float(len(contexts)),
                "floor_s": max(
                    alone[pool_of[g.engine[j]]](t) for g in batch for j, t in enumerate(g.members)
                ),
            }
        )
        if not mode.update_at_take:
            refill()
            sim.call_at(sim.now + train_s, functools.partial(update, finish_step))
        elif version < trained:
            update(functools.partial(train_now, train_s))
        else:
            train_now(train_s)

    def train_now(train_s: float) -> None:
        refill()
        sim.call_at(sim.now + train_s, finish_step)

    def update(then: Callable[[], None]) -> None:
        """Move the fleet to the newest trained weights, then go on with ``then``."""
        for e in near:
            sim.pause(e)
        if far and mode.alpha == 0:
            for e in far:
                sim.pause(e)
        if far:
            sim.call_at(sim.now + fetch_s, functools.partial(load_far, version + 1))
        sim.call_at(sim.now + pause_s, functools.partial(commit, then))

    def load_far(new: int) -> None:
        for e in far:
            sim.pause(e)
        sim.call_at(sim.now + load_s, functools.partial(commit_far, new))

    def commit_far(new: int) -> None:
        for e in far:
            sim.update_weights(e, str(new))
            sim.resume(e)

    def commit(then: Callable[[], None]) -> None:
        nonlocal version
        version += 1
        for e in near:
            sim.update_weights(e, str(version))
        for g in [g for g in groups.values() if g.left and not bound.admits(g.start_version, version)]:
            drop(g)
        for e in near:
            sim.resume(e)
        then()

    def finish_step() -> None:
        nonlocal trainer_busy, waiting_since, trained
        trained += 1
        ends.append(sim.now)
        trainer_busy = False
        waiting_since = sim.now
        if len(ends) < steps:
            refill()
            take()
            return
        for g in groups.values():  # the run is over: stop what is still generating, uncounted
            g.live = False
            for j in range(len(g.members)):
                if g.rid[j]:
                    sim.abort(engines[g.engine[j]], g.rid[j])

    refill()
    sim.run()
    measured = per_step[warmup:steps]
    gaps = np.diff([0.0, *ends])[warmup:steps]
    mix: dict[str, float] = {}
    for row in measured:
        for k, v in row.items():
            if k.startswith("task:"):
                mix[k[5:]] = mix.get(k[5:], 0.0) + v
    total = sum(mix.values()) or 1.0
    return TrainingResult(
        mode=mode.name,
        steps=len(ends),
        step_time_s=float(np.mean(gaps)) if len(gaps) else 0.0,
        step_ends_s=ends,
        train_s=float(np.mean([s["train_s"] for s in measured])) if measured else 0.0,
        sync_s=exposed_s,
        wait_s=float(np.mean([s["wait_s"] for s in measured])) if measured else 0.0,
        tail_floor_s=float(np.mean([s["floor_s"] for s in measured])) if measured else 0.0,
        aborted_fraction=aborted / max(1, started),
        aborted_tokens=aborted_tokens,
        trained_tokens=float(np.mean([s["tokens"] for s in measured])) if measured else 0.0,
        batch_mix={k: v / total for k, v in sorted(mix.items())},
        staleness_mean=float(np.mean([s["staleness"] for s in measured])) if measured else 0.0,
        staleness_max=int(max((s["staleness_max"] for s in per_step), default=0)),
        policy_lag_max=int(max((s["lag_max"] for s in per_step), default=0)),
        wall_s=time.perf_counter() - wall0,
        per_step=per_step,
    )

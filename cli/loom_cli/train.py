"""``loom train``: GRPO on a real policy through Loom's own services, on the CPU.

A small Qwen3-architecture policy (built from a config and warm-started on demonstrations, or a local
checkpoint with ``--base``) learns a multi-turn task with a tool: ``coin`` (the default: open boxes with a
tool to find a coin, guided by a clue; the warm start imitates a careless player who follows the clue in half
of the games and writes one call in seven as ``Open[three]``, which ends the game) or ``arith`` (arithmetic
with a sandboxed Python calculator in the ``math`` environment). Each mode starts the
embedded system with rollout workers on the transformers engine, opens a rollout stream, and loops: take a
batch of groups, one GRPO update, save a checkpoint, push it to every worker (``update_weights``). The
held-out tasks are scored through a Loom job before the first update and after the last; the same steps run
again with async_bound 0 (synchronous RL) for the wall-time comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import json
import logging
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loom import checkpoints as policy
from loom.envs import coin, registry, tasksets
from loom.protocol import SamplingParams, StreamSpec
from loom.protocol.messages import TERMINAL_JOB_STATES
from loom.runtime import bus, lifecycle
from loom.trainer.client import StreamClient
from loom.trainer.coin_warmstart import coin_warm_start, demonstration
from loom.trainer.grpo import GRPOConfig
from loom.trainer.grpo_trainer import GRPOTrainer
from loom.trainer.warmstart import TINY_POLICY, warm_start
from loom.weights.publish import transport
from loom_cli.client import LoomClient
from loom_cli.deploy import DeployConfig, Deployment, free_port
from loom_cli.train_report import plot

log = logging.getLogger(__name__)
MODEL = "qwen3-tiny"
IS_WEIGHT_TOLERANCE = 0.01
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}


@dataclass(frozen=True)
class Task:
    env: str
    train: str
    heldout: str
    max_turns: int
    max_tokens: int
    turn_tokens: int
    warm_steps: int


TASKS = {
    # Open[N] with its stop token is about six tokens; four tries at most. The warm start imitates a
    # demonstrator that follows the clue in half its games: 300 steps (4,800 games) left the policy blind to the
    # clue (42% of its first boxes allowed by it, chance 45%), and 30 GRPO steps do not teach it (41% after),
    # so the held-out reward stayed under the clue-blind player's 0.47 and its gain depended on the draw; at
    # 1,000 steps (of 32 games) it follows the clue in 74% of first boxes (the demonstrator: 72%).
    "coin": Task("coin", "coin", "coin-eval", max_turns=4, max_tokens=32, turn_tokens=8, warm_steps=1000),
    "arith": Task("math", "arith", "arith-eval", max_turns=3, max_tokens=96, turn_tokens=48, warm_steps=300),
}


@dataclass
class TrainConfig:
    task: str = "coin"
    steps: int = 60
    groups: int = 8
    group_size: int = 8
    async_bound: int = 1
    workers: int = 1
    # None: the task's own (Task.warm_steps).
    warm_steps: int | None = None
    eval_tasks: int = 300
    eval_samples: int = 2
    seed: int = 0
    base: str | None = None
    weights: str = "collective"  # the transport each update takes (loom.weights.publish)
    # Overrides of loom.checkpoints.TINY; None: the one each task's recipe was measured with.
    model: dict[str, Any] | None = None
    sync: bool = True
    lr: float = 1e-3
    # Optimizer steps per batch (GRPOConfig.minibatches): with one, 30 steps move no weight by more than 30 lr.
    minibatches: int = 4
    # A control run: "shuffled" hands GRPO each batch's rewards in random order.
    control: str | None = None
    # The coin warm start's demonstrator: share of games that follow the clue, share of careless calls.
    follow: float = 0.5
    slip: float = 0.15


PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    # 12 groups: with 8 at lr 1e-3, one run in three let a noisy update undo the gain. lr 1e-3: at 7e-4 the clip
    # never bound (clip_frac 0) and 30 steps left the careless calls where the warm start put them (76 -> 75
    # games of 400), below the random player (0.435 against 0.47); at 1e-3, 87 -> 44 and 0.52. At 1.5e-3 it
    # learns as much (0.54) but the shuffled-reward control loses reward (-0.08, interval below 0): random
    # updates that large walk the policy away from its warm start.
    "quick": {"steps": 30, "groups": 12, "lr": 1e-3, "eval_tasks": 200},
    # For `make test`: the smallest run that still goes through every part.
    "tiny": {"steps": 2, "groups": 2, "group_size": 4, "warm_steps": 30, "eval_tasks": 8, "eval_samples": 1},
}


@dataclass
class ModeResult:
    async_bound: int
    wall_s: float
    steps: list[dict[str, Any]]
    eval_first: dict[str, float] = field(default_factory=dict)
    eval_last: dict[str, float] = field(default_factory=dict)
    # Failed trajectories, the reasons games ended, and (coin) the share of opened boxes the clue allows.
    heldout_first: dict[str, Any] = field(default_factory=dict)
    heldout_last: dict[str, Any] = field(default_factory=dict)


def config_of(args: argparse.Namespace) -> TrainConfig:
    preset = "tiny" if args.tiny else "quick" if args.quick else "full"
    cfg = TrainConfig(**PRESETS[preset])
    names = ("task", "steps", "groups", "group_size", "async_bound", "workers", "warm_steps", "eval_tasks")
    for name in (*names, "seed", "lr"):
        v = getattr(args, name)
        if v is not None:
            setattr(cfg, name, v)
    cfg.base = args.base
    cfg.weights = args.weights
    cfg.sync = not args.no_sync
    cfg.control = args.control
    if cfg.warm_steps is None:
        cfg.warm_steps = TASKS[cfg.task].warm_steps
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    torch.set_num_threads(1)
    keep_freed_memory()
    seeds = max(1, args.seeds)
    # With several seeds each runs the whole pipeline, warm start included, in a folder of its own.
    runs = [
        run_once(replace(cfg, seed=cfg.seed + k), out if seeds == 1 else out / f"seed{cfg.seed + k}", console)
        for k in range(seeds)
    ]
    summary = runs[0] if seeds == 1 else spread(runs)
    if seeds > 1:
        (out / "train.json").write_text(json.dumps({"summary": summary}, indent=2))
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        console.print_json(json.dumps(summary))
    bad = [
        r["is_weight_mean_sync"]
        for r in runs
        if abs(r.get("is_weight_mean_sync", 1.0) - 1.0) > IS_WEIGHT_TOLERANCE
    ]
    if bad:
        console.print(
            f"[bold red]loom train: at async_bound 0 the mean importance weight is {bad[0]}, not 1 ± "
            f"{IS_WEIGHT_TOLERANCE}: the engine's log-probabilities disagree with the trainer's for the same "
            "weights, so the samples were not on-policy[/]"
        )
        return 3
    return 0


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for the next allocation instead of giving it back to the system. It serves a
    block of more than 32 MiB from a fresh mapping and unmaps it at free, so the warm start's two dense gradients
    of the embedding (151,680 x 64 floats, 39 MB each) were zeroed on new pages, fault by fault, at every step: a
    third of the step. Kept, a step of the coin warm start takes 0.13 s instead of 0.18 (page faults 1.4 million
    to 0.2 over 60 steps, beside other jobs), with the same losses to the last bit. Other threads, which
    allocate from arenas of their own (the trainer's step runs in one), are not helped: decode steps run in a
    thread faulted as often with it as without (measured). A no-op where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 1 << 30)  # blocks under 1 GiB come from the heap...
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)  # ...which keeps up to 1 GiB free at its top rather than trimming it


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def run_once(cfg: TrainConfig, out: Path, console: Console) -> dict[str, Any]:
    """The whole pipeline once: warm start, each mode's training through Loom, the held-out scores."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ckpt0 = initial_checkpoint(cfg, out, console)
    modes = [cfg.async_bound] + ([0] if cfg.sync and cfg.async_bound != 0 else [])
    # The first mode is scored before and after; the others start from the same checkpoint and are scored after.
    results = []
    for a in modes:
        lifecycle.stop_if_terminated()
        results.append(asyncio.run(run_mode(cfg, a, ckpt0, out / f"alpha{a}", a == modes[0], console)))
        lifecycle.stop_if_terminated()
    main = results[0]
    summary = summarize(cfg, main, results[1] if len(results) > 1 else None)
    summary["total_wall_s"] = round(time.monotonic() - t0, 1)
    (out / "train.json").write_text(
        json.dumps({"summary": summary, "modes": [asdict(r) for r in results]}, indent=2)
    )
    plot(results, out / "train.png", summary.get("baseline_random"))
    console.print(f"plot: {out / 'train.png'}; report: {out / 'train.json'}")
    return summary


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several seeds' runs: each summary, and the mean and standard deviation of what varies between them."""
    out: dict[str, Any] = {"seeds": len(runs), "runs": runs}
    for key in ("reward_first", "reward_last", "reward_gain", "sync_reward_last", "speedup_vs_sync"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if len(values) > 1:
            out[f"{key}_mean"] = round(statistics.fmean(values), 4)
            out[f"{key}_sd"] = round(statistics.stdev(values), 4)
    out["gain_intervals_above_0"] = sum(r["reward_gain_ci95"][0] > 0 for r in runs)
    return out


def initial_checkpoint(cfg: TrainConfig, out: Path, console: Console) -> Path:
    """Version 0: the base checkpoint, or a tiny policy warm-started on demonstrations."""
    if cfg.base is not None:
        return Path(cfg.base)
    shape = cfg.model if cfg.model is not None else SMALL if cfg.task == "coin" else TINY_POLICY
    model = policy.build_tiny(seed=cfg.seed, **shape)
    warm_steps = cfg.warm_steps or 0
    if warm_steps > 0:
        if cfg.task == "coin":
            # ReAct actions (Open[N]) are the shortest form the environment parses.
            demos = list(coin.coin_tasks("train").values())
            fn: Any = functools.partial(
                coin_warm_start, model, demos, form="react", follow=cfg.follow, slip=cfg.slip
            )
        else:
            fn = functools.partial(warm_start, model, list(tasksets.arith("train").values()))
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=console) as progress:
            bar = progress.add_task("warm start", total=warm_steps)
            res = fn(
                steps=warm_steps,
                seed=cfg.seed,
                log=lambda m: progress.update(
                    bar, completed=m["step"] + 1, description=f"warm start loss {m['loss']:.3f}"
                ),
            )
        console.print(f"warm start: {warm_steps} steps, loss {res['loss']:.3f}")
    return policy.save(model, out / "ckpt" / "v0")


def stream_spec(cfg: TrainConfig, alpha: int) -> StreamSpec:
    task = TASKS[cfg.task]
    return StreamSpec(
        name=f"loom train (async_bound {alpha})",
        env=task.env,
        model=MODEL,
        dataset={"name": task.train},  # type: ignore[arg-type]
        group_size=cfg.group_size,
        max_turns=task.max_turns,
        max_tokens=task.max_tokens,
        max_turn_tokens=task.turn_tokens,
        # Seeded: a rerun samples what this one did wherever the arithmetic repeats (a request id names the
        # stream, a new one each run, and would draw anew).
        sampling=SamplingParams(temperature=1.0, logprobs=True, seeded=True),
        tool_timeout_s=10.0,
        seed=cfg.seed,
        async_bound=alpha,
        # alpha batches in flight: each batch is started by the version that trains alpha batches earlier,
        # so none is dropped as stale; alpha = 0 generates one batch per version (synchronous RL), alpha = 1
        # the next batch while this one trains (StreamRL's one-off overlap).
        buffer_groups=cfg.groups * max(1, alpha),
        epochs=None,
        shuffle_seed=cfg.seed,
    )


async def run_mode(
    cfg: TrainConfig, alpha: int, ckpt0: Path, out: Path, first: bool, console: Console
) -> ModeResult:
    dep = Deployment(
        DeployConfig(
            home=out / "loom",
            workers=cfg.workers,
            api_port=free_port(),
            model=MODEL,
            engine="hf",
            model_path=str(ckpt0),
            log_level="WARNING",
            extra_env={"LOOM_ROLLOUT_THREADS": "1", "LOOM_ROLLOUT_MAX_RUNNING": "64"},
        )
    )
    console.print(f"[bold]async_bound {alpha}[/]: {cfg.workers} worker(s), logs in {dep.cfg.home / 'logs'}")
    await dep.start(wait_s=180)
    result = ModeResult(alpha, 0.0, [])
    try:
        if first:
            result.eval_first = await asyncio.to_thread(
                score_heldout, dep.api_url, dep.api_token, cfg, console, "before", result.heldout_first
            )
        lifecycle.stop_if_terminated()
        nc = await bus.connect(dep.nats.url, "loom-train", credentials=dep.credentials("trainer"))
        torch.manual_seed(cfg.seed)
        shuffle = random.Random(cfg.seed) if cfg.control == "shuffled" else None
        trainer = GRPOTrainer(
            policy.load(ckpt0), GRPOConfig(lr=cfg.lr, minibatches=cfg.minibatches), shuffle_rewards=shuffle
        )
        # The version goes to the fleet by cfg.weights: broadcast from this process (no checkpoint per step),
        # published to the bus's object store, or written under out/ckpt.
        mover = transport(cfg.weights, root=out / "ckpt", js=nc.jetstream(timeout=60))  # type: ignore[arg-type]
        t0 = time.monotonic()
        stream = await StreamClient.create(nc, stream_spec(cfg, alpha))
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        try:
            with Progress(*cols, console=console) as progress:
                bar = progress.add_task(f"train (async_bound {alpha})", total=cfg.steps)
                for step in range(cfg.steps):
                    lifecycle.stop_if_terminated()
                    batch = await stream.get_batch(cfg.groups, timeout=900)
                    waited = batch.waited_s
                    rep = await asyncio.to_thread(trainer.step, batch)
                    upd = await stream.update_weights(step + 1, model=trainer.model, transport=mover)
                    result.steps.append(
                        {
                            "step": step + 1,
                            "wall_s": round(time.monotonic() - t0, 2),
                            "batch_version": rep.version,
                            "reward": round(rep.reward_mean, 4),
                            "staleness_max": rep.staleness_max,
                            "staleness_mean": round(rep.staleness_mean, 3),
                            "stale_dropped": batch.stale,
                            "trained": rep.trained,
                            "skipped": rep.skipped,
                            "wait_s": round(waited, 2),
                            "train_s": round(rep.train_s, 2),
                            "update_s": round(upd.total_s, 2),
                            # RollArt §5.2: loading while the engines generate; held only to switch.
                            "update_fetch_s": round(upd.fetch_s, 3),
                            "update_pause_s": round(upd.pause_s, 3),
                            **{k: round(v, 4) for k, v in rep.metrics.items()},
                        }
                    )
                    progress.update(
                        bar,
                        completed=step + 1,
                        description=f"train (async_bound {alpha}) reward {rep.reward_mean:.2f}",
                    )
            result.wall_s = round(time.monotonic() - t0, 1)
        finally:
            await stream.close()
            await nc.drain()
        lifecycle.stop_if_terminated()
        result.eval_last = await asyncio.to_thread(
            score_heldout,
            dep.api_url,
            dep.api_token,
            cfg,
            console,
            f"after (async_bound {alpha})",
            result.heldout_last,
        )
    finally:
        await dep.stop()
    return result


def score_heldout(
    api: str, token: str, cfg: TrainConfig, console: Console, label: str, details: dict[str, Any]
) -> dict[str, float]:
    """Mean reward per held-out task of the policy the fleet serves now, through a Loom job. A trajectory that
    failed (an engine or environment error) is counted in ``details["failed"]``, not scored as 0; ``details``
    also gets the reasons the games ended and, for coin, the share of opened boxes the clue allows."""
    task = TASKS[cfg.task]
    client = LoomClient(api, token)
    try:
        job = client.submit(
            {
                "name": f"loom train: held-out eval {label}",
                "env": task.env,
                "model": MODEL,
                "dataset": {"name": task.heldout, "limit": cfg.eval_tasks},
                "group_size": cfg.eval_samples,
                "max_turns": task.max_turns,
                "max_tokens": task.max_tokens,
                "max_turn_tokens": task.turn_tokens,
                # Seeded: the evaluations before and after training draw each call from the same seed (common
                # random numbers), so their difference is the policy's, not the draws'.
                "sampling": {"temperature": 1.0, "seeded": True},
                "seed": cfg.seed,
            }
        )
        deadline = time.monotonic() + 900
        while job["state"] not in TERMINAL_JOB_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"held-out eval {job['id']} did not finish")
            time.sleep(0.5)
            job = client.job(job["id"])
        per_task: dict[str, list[float]] = defaultdict(list)
        reasons: Counter[str] = Counter()
        allowed = opened = failed = 0
        for line in client.trajectories(job["id"]):
            t = json.loads(line)
            if t["status"] != "completed" or t["reward"] is None:
                failed += 1
                continue
            per_task[t["task_id"]].append(float(t["reward"]))
            verdict = t["info"].get("verdict") or {}
            reasons[str(verdict.get("reason", t["finish_reason"]))] += 1
            if cfg.task == "coin":
                a, n = coin.clue_consistent(coin.coin_tasks("eval")[t["task_id"]], verdict.get("opened", []))
                allowed, opened = allowed + a, opened + n
    finally:
        client.close()
    scores = {k: statistics.fmean(v) for k, v in per_task.items()}
    details.update({"failed": failed, "reasons": dict(reasons.most_common())})
    if cfg.task == "coin":
        details["clue_consistent"] = round(allowed / opened, 4) if opened else None
    console.print(
        f"held-out reward {label}: {statistics.fmean(scores.values()):.3f} over {len(scores)} tasks"
        + (f" ({failed} trajectories failed)" if failed else "")
    )
    return scores


def prompt_of(cfg: TrainConfig) -> dict[str, str]:
    """The prompt each held-out task shows the policy, by task id (coin: games of a prompt differ by the coin)."""
    task = TASKS[cfg.task]
    ids = registry.task_ids(task.env, task.heldout, None)[: cfg.eval_tasks]
    return {t.id: str(t.data["prompt"]) for t in registry.task_specs(task.env, task.heldout, None, ids)}


def baselines(cfg: TrainConfig) -> dict[str, float]:
    """What the held-out coin games give without learning: distinct boxes at random, the best clue-blind fixed
    order (from the training games), and the warm start's demonstrator (mean of 20 plays a game)."""
    if cfg.task != "coin":
        return {}
    tasks = list(coin.coin_tasks("eval").values())[: cfg.eval_tasks]
    orders = coin.fixed_orders(list(coin.coin_tasks("train").values()))
    rng = random.Random(cfg.seed)
    demo = [coin.play_value(t, demonstration(t, rng, cfg.follow, cfg.slip)) for t in tasks for _ in range(20)]
    return {
        "baseline_random": round(statistics.fmean(coin.random_value(t) for t in tasks), 4),
        "baseline_fixed_order": round(statistics.fmean(coin.fixed_order_value(t, orders) for t in tasks), 4),
        "baseline_demonstrator": round(statistics.fmean(demo), 4),
    }


def paired_gain_ci(
    first: dict[str, float],
    last: dict[str, float],
    prompts: dict[str, str] | None = None,
    n: int = 4000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean gain over the prompts both evaluations scored, with a 95% percentile-bootstrap interval that
    resamples prompts (a prompt's games are its cluster: they share everything the policy sees). ``prompts``
    maps task ids to their prompt; without it every task is its own prompt."""
    keys = sorted(set(first) & set(last))
    if not keys:
        return 0.0, 0.0, 0.0
    cluster: dict[str, list[float]] = defaultdict(list)
    for k in keys:
        cluster[prompts.get(k, k) if prompts else k].append(last[k] - first[k])
    d = [statistics.fmean(v) for _, v in sorted(cluster.items())]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(d, k=len(d))) for _ in range(n))
    return statistics.fmean(d), means[int(0.025 * n)], means[int(0.975 * n) - 1]


def _mean(steps: list[dict[str, Any]], key: str) -> float | None:
    return round(statistics.fmean(s[key] for s in steps), 3) if steps else None


def summarize(cfg: TrainConfig, main: ModeResult, sync: ModeResult | None) -> dict[str, Any]:
    prompts = prompt_of(cfg)
    gain, lo, hi = paired_gain_ci(main.eval_first, main.eval_last, prompts, seed=cfg.seed)
    first = statistics.fmean(main.eval_first.values()) if main.eval_first else None
    last = statistics.fmean(main.eval_last.values()) if main.eval_last else None
    k = max(1, min(3, len(main.steps) // 3))
    batch_rewards = [s["reward"] for s in main.steps]
    out: dict[str, Any] = {
        "reward_first": None if first is None else round(first, 4),
        "reward_last": None if last is None else round(last, 4),
        "reward_gain": round(gain, 4),
        "reward_gain_ci95": [round(lo, 4), round(hi, 4)],
        "eval_tasks": len(main.eval_first),
        "train_reward_first": round(statistics.fmean(batch_rewards[:k]), 4) if batch_rewards else None,
        "train_reward_last": round(statistics.fmean(batch_rewards[-k:]), 4) if batch_rewards else None,
        "steps": len(main.steps),
        "weight_versions": len(main.steps) + 1,
        "max_staleness": max((s["staleness_max"] for s in main.steps), default=0),
        "async_bound": main.async_bound,
        "wall_s": main.wall_s,
        "sync_wall_s": sync.wall_s if sync is not None else None,
        # Per weight update, mean: the engines loaded while generating, then paused only to switch.
        "update_fetch_s": _mean(main.steps, "update_fetch_s"),
        "update_pause_s": _mean(main.steps, "update_pause_s"),
    }
    if sync is not None and main.wall_s > 0:
        out["speedup_vs_sync"] = round(sync.wall_s / main.wall_s, 3)
    if sync is not None:
        out["sync_reward_last"] = (
            round(statistics.fmean(sync.eval_last.values()), 4) if sync.eval_last else None
        )
    # At bound 0 every sample comes from the weights the trainer holds: the engine's log-probabilities and the
    # trainer's agree, and the importance weight is 1 (RL on a mismatched sampler is not on-policy).
    on_policy = sync if sync is not None else main if main.async_bound == 0 else None
    weights = [s["is_weight"] for s in on_policy.steps if s.get("trained_tokens")] if on_policy else []
    if weights:  # a step whose groups all scored alike trained on nothing and weighed nothing
        out["is_weight_mean_sync"] = round(statistics.fmean(weights), 5)
        # After each update, the fleet's log-probs of the tokens it made against the trainer's for the same
        # weights: the largest gap of any token of any step (0.02: TRL's guard on sampling mismatch).
        diffs = [s["logprob_max_abs_diff"] for s in on_policy.steps if s.get("trained_tokens")]  # type: ignore[union-attr]
        out["logprob_max_abs_diff_sync"] = round(max(diffs), 5)
    out["weights_transport"] = cfg.weights
    out["eval_prompts"] = len({prompts[k] for k in main.eval_first if k in prompts})
    for when, h in (("first", main.heldout_first), ("last", main.heldout_last)):
        if h:
            out[f"failed_{when}"] = h["failed"]
            out[f"end_reasons_{when}"] = h["reasons"]
            if "clue_consistent" in h:
                out[f"clue_consistent_{when}"] = h["clue_consistent"]
    out.update(baselines(cfg))
    if "baseline_random" in out:
        # Reward against wall time: when the batch reward (mean of 5 steps) first reaches chance's.
        out["time_to_random_s"] = time_to(main.steps, out["baseline_random"])
        if sync is not None:
            out["sync_time_to_random_s"] = time_to(sync.steps, out["baseline_random"])
    if cfg.control is not None:
        out["control"] = cfg.control
    return out


def time_to(steps: list[dict[str, Any]], target: float, window: int = 5) -> float | None:
    """The wall seconds at which the mean batch reward of the last ``window`` steps first reaches ``target``."""
    for i in range(window - 1, len(steps)):
        if statistics.fmean(s["reward"] for s in steps[i - window + 1 : i + 1]) >= target:
            return float(steps[i]["wall_s"])
    return None

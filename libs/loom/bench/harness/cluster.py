"""The rollout workers of a simulated cluster: how many, and at which model-parallel degree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loom.engine.model.perf import PerfModel
from loom.policies.partition import WorkerProfile
from loom.policies.profiles import STEP_TOKENS, placement_profile, tool_seconds
from loom.policies.resources import ResourceProblem, anneal, representable
from loom.protocol import ResolvedPolicy
from loom.workloads.coding import TOOL_MEAN_S as CODING_TOOL_S

# Heddle §7.1: the baselines run MP 1, 1 and 2 for Qwen3-8B, 14B and 32B (maximum throughput).
BASELINE_MP = {"qwen3-8b": 1, "qwen3-14b": 1, "qwen3-32b": 2}
DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Cluster:
    gpus: int = 64
    gpu: str = "h100"
    model: str = "qwen3-14b"
    max_running: int = 256
    # The profiles' reference context: a trajectory whose mean context is k times this weighs k in a group.
    context_len: int = 16_384
    tool_s: float = CODING_TOOL_S
    # Output tokens of a step: with ``tool_s``, the share of a trajectory's time it spends generating.
    step_tokens: float = STEP_TOKENS

    def holds(self, degree: int, context: int) -> bool:
        """Whether a worker at ``degree`` can serve a request of ``context`` tokens (a workload's
        ``max_context``): every engine serves whichever trajectory the router sends it, and vLLM refuses to
        start with a ``max_model_len`` its KV cache cannot hold."""
        return PerfModel(self.gpu, self.model, degree).kv_capacity_tokens() >= max(1, context)

    def degrees_that_fit(self, context: int) -> list[int]:
        return [d for d in DEGREES if d <= self.gpus and self.holds(d, context)]

    def profile(self, degree: int, max_group: int) -> WorkerProfile:
        """F and T of a worker at ``degree``: the closed form, under any queue order."""
        return placement_profile(
            self.model,
            self.gpu,
            degree,
            context_len=self.context_len,
            max_running=self.max_running,
            tool_s=self.tool_s,
            max_group=max_group,
            step_tokens=self.step_tokens,
        )


def fixed_degree(policy: ResolvedPolicy, cluster: Cluster) -> int | None:
    """The one degree every worker runs at under a policy that fixes it (its MP, else the model's baseline
    MP); None where the allocation is annealed. Raises where the cluster's GPUs do not split into it."""
    if policy.resources == "adaptive":
        return None
    mp = policy.fixed_mp if policy.fixed_mp > 1 else BASELINE_MP.get(cluster.model, 1)
    if cluster.gpus % mp:
        raise ValueError(
            f"{cluster.gpus} GPUs cannot all run {cluster.model} at MP {mp}: give a multiple of {mp}"
        )
    return mp


def tool_time(cluster: Cluster, predicted: float) -> float:
    """A trajectory's predicted seconds in tools: its predicted calls (its predicted output over a step's
    tokens) at the cluster's tool time per call."""
    return tool_seconds(predicted, cluster.tool_s, cluster.step_tokens)


def allocate(
    policy: ResolvedPolicy,
    cluster: Cluster,
    predicted: Sequence[float],
    seed: int = 0,
    weights: Sequence[float] | None = None,
    prefill: Sequence[float] | None = None,
    tool: Sequence[float] | None = None,
    log_sd: float = 0.0,
    context: int = 0,
) -> list[int]:
    """Worker degrees, largest first: the job's fixed MP, the model's baseline MP, or annealed (Heddle §6),
    the annealing weighing each trajectory's tool seconds (``tool``, else ``tool_time``'s estimate), which
    no degree shortens, and pricing each allocation at the predictor's error ``log_sd`` (the log sd of
    actual over ``predicted``; 0: exact), on degrees that hold a request of ``context`` tokens, on as many
    of the GPUs as those degrees can split (where degree 1 cannot hold it, an odd GPU is left idle)."""
    if policy.resources == "adaptive":
        fits = cluster.degrees_that_fit(context)
        if not fits:
            raise ValueError(
                f"no degree up to {min(cluster.gpus, DEGREES[-1])} of {cluster.model} on {cluster.gpu} holds "
                f"a request of {context} tokens"
            )
        gpus = next(g for g in range(cluster.gpus, 0, -1) if representable(g, tuple(fits)))
        top = len(predicted) if weights is None else int(np.ceil(sum(weights))) + 1
        profiles = {d: cluster.profile(d, top) for d in fits}
        problem = ResourceProblem(
            predicted,
            gpus,
            profiles,
            weights=weights,
            prefill=prefill,
            tool=[tool_time(cluster, p) for p in predicted] if tool is None else tool,
            log_sd=log_sd,
            seed=seed,
        )
        return list(anneal(problem, seed=seed).degrees)
    mp = fixed_degree(policy, cluster)
    assert mp is not None
    if not cluster.holds(mp, context):
        raise ValueError(
            f"{cluster.model} at MP {mp} on {cluster.gpu} cannot hold a request of {context} tokens"
        )
    return [mp] * (cluster.gpus // mp)

"""The ``Engine`` interface the rollout service drives. Times are simulated seconds of the engine's clock."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Literal, Protocol

from loom.weights import Incoming

# The sampling fields beyond temperature and top_p, each at the value that leaves the distribution as it is. An
# engine client sends them all explicitly (a server fills what a request leaves out from its own defaults, e.g. a
# checkpoint's generation_config), so that what is sampled is what Loom records: the distribution at the
# request's temperature and top_p.
NEUTRAL_SAMPLING: dict[str, float] = {
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


@dataclass(frozen=True)
class EngineInfo:
    kind: str  # "sim" | "sglang"
    model: str
    gpu: str
    tp: int
    max_running: int
    kv_capacity_tokens: int
    # The longest context (prompt and output) one request may have; 0: bounded by the KV cache only.
    max_context_tokens: int = 0


@dataclass
class EngineRequest:
    rid: str
    input_len: int
    max_new_tokens: int
    input_ids: list[int] | None = None
    # Requests with the same prefix_key share a cached prefix (one trajectory's growing context).
    prefix_key: str | None = None
    # Where the input's start is the same as other trajectories': (key, tokens) levels of a radix tree, the
    # shortest first. E.g. the system prompt every trajectory of a task set starts with, then the prompt a GRPO
    # group's samples share. Real engines find such prefixes in their cache by content (SGLang's radix tree,
    # vLLM's block hashes); the simulated one keys its cache by trajectory (``prefix_key``: none, none shared),
    # so it is told where they coincide.
    shared_prefix: tuple[tuple[str, int], ...] = ()
    ignore_eos: bool = False
    # Larger value = served first (SGLang's convention with --enable-priority-scheduling).
    priority: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    # Also return the log-probability of every sampled token under the distribution it was sampled from.
    return_logprob: bool = False
    # End the output at the first of these strings or token ids (the token that completes it included),
    # where the engine can; the environment manager cuts at the first one in any case.
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Also return each output token's ``top_logprobs`` most likely alternatives (0: none).
    top_logprobs: int = 0
    # Teacher forcing: the output is these tokens, not sampled ones (a scripted reply), and each one's
    # log-probability is that of the model given ``input_ids`` and the forced tokens before it, under the
    # request's temperature where the engine can. ``max_new_tokens`` caps them (the reply is cut there, as a
    # sampled one would be); ``finish_reason`` is "length".
    forced_ids: list[int] | None = None
    # Sample from this seed, not the engine's own stream: the same seed, input and weights draw the same
    # tokens (vLLM's per-request ``seed``, SGLang's ``sampling_seed``).
    seed: int | None = None


@dataclass
class EngineOutput:
    rid: str
    output_len: int
    finish_reason: Literal["length", "stop", "abort"]
    output_ids: list[int] | None = None
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0
    weight_version: str = ""
    output_logprobs: list[float] | None = None
    # Per output token, its top alternatives as (token id, log-prob), most likely first (``top_logprobs``).
    output_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class EngineLoad:
    running: int
    waiting: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    generated_tokens: int
    extra: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    info: EngineInfo

    async def start(self) -> None: ...

    async def close(self) -> None:
        """Abort everything in flight and release resources."""

    async def generate(self, req: EngineRequest) -> EngineOutput:
        """Run one request to completion. Cancelling the awaiting task aborts the request."""

    async def abort(self, rid: str) -> bool:
        """Abort a queued or running request; its ``generate`` returns with finish_reason "abort"."""

    def load(self) -> EngineLoad: ...

    async def warm_prefix(self, prefix_key: str, input_len: int) -> None:
        """Prefill ``input_len`` tokens of ``prefix_key`` into the prefix cache (migration target warm-up)."""

    async def prepare_weights(self, version: str, weights: Incoming) -> None:
        """Take ``weights`` (a checkpoint on disk, a broadcast, a store's version: ``loom.weights``) and check
        them beside the weights serving now, without switching.

        Raises (and keeps serving the old weights) when they cannot serve: the first phase of a fleet update,
        which switches no worker unless every worker prepared."""

    async def commit_weights(self, version: str) -> None:
        """Serve the prepared weights as ``version`` from now on; requests in flight continue under them."""

    async def discard_weights(self, version: str) -> None:
        """Drop weights prepared for ``version`` (another worker failed to prepare)."""

    async def pause(self) -> None:
        """Hold every request where it is (queued and running ones wait, none fails) until ``resume``."""

    async def resume(self) -> None: ...


async def cancel_loop(task: asyncio.Task[None] | None) -> None:
    """Stop an engine's iteration loop and wait until it has (a closing engine calls this after aborting
    its requests)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

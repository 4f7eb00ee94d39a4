"""The transformers engine's tensor side: per-request state, the batched KV cache, prefill and sampling.

Everything here runs on the engine's worker thread under ``torch.inference_mode``; the event loop only reads
what a ``Seq`` has produced so far.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.token_ids import seed63
from loom.text.tokenizer import STOP_IDS

FinishReason = Literal["length", "stop", "abort"]


def request_generator(seed: int, rid: str, request_seed: int | None = None) -> torch.Generator:
    """A generator per request, derived from the engine's seed and the request's own seed, or its rid where it
    has none: a request samples the same tokens whatever it happens to be batched with, and whether or not its
    KV cache was recomputed."""
    name = rid if request_seed is None else f"seed {request_seed}"
    return torch.Generator().manual_seed(seed63(f"{seed}:{name}"))


@dataclass(eq=False)
class Seq:
    req: EngineRequest
    prompt: list[int]
    order: int
    future: asyncio.Future[EngineOutput]
    generator: torch.Generator
    submitted: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Each output token's top alternatives (id, log-prob), when the request asks for ``top_logprobs``.
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    # Set once, by the worker thread (stop, length) or by the event loop (abort), whichever comes first.
    finish_reason: FinishReason | None = None
    admitted: float | None = None
    prefill_s: float = 0.0
    prefilled: float | None = None

    @property
    def budget(self) -> int:
        """KV tokens this request may come to hold: admission reserves them, so nothing is ever preempted."""
        return len(self.prompt) + self.req.max_new_tokens

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output_ids)

    def append(self, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        # The logprob goes first: the event loop may snapshot an aborted request at any moment, and it cuts
        # every list to len(output_ids).
        self.logprobs.append(logprob)
        if top is not None:
            self.top.append(top)
        self.output_ids.append(token)
        if self.finish_reason is not None:
            return
        if self.req.forced_ids is not None:
            return  # a forced reply runs to its end (``score`` finishes it)
        if (token in STOP_IDS and not self.req.ignore_eos) or token in (self.req.stop_token_ids or ()):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.req.max_new_tokens:
            self.finish_reason = "length"


@functools.cache
def _cache_kwarg(forward: Callable[..., object]) -> str:
    # transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns, and goes
    # in 5.40); older releases, verl's pin among them, know only the old one.
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def with_cache(model: PreTrainedModel, cache: DynamicCache | None) -> dict[str, DynamicCache | None]:
    """The keyword that hands ``cache`` to ``model``'s forward, under this transformers release's name."""
    return {_cache_kwarg(type(model).forward): cache}


def prefill(model: PreTrainedModel, ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
    """The KV cache of ``ids`` alone (batch 1, no padding) and the logits after its last token."""
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([ids]), **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


def score(model: PreTrainedModel, seq: Seq, forced: list[int]) -> None:
    """Teacher forcing: one forward pass over the prompt and ``forced``, appending each forced token with its
    log-prob (and top alternatives) under the temperature-scaled distribution a sampled token would have had
    at its position (``_sample``'s)."""
    n = len(seq.prompt)
    out = model(input_ids=torch.tensor([seq.prompt + forced[:-1]]), logits_to_keep=len(forced))
    logits = out.logits[0].float()
    temp = seq.req.temperature if seq.req.temperature > 0 else 1.0
    logps = torch.log_softmax(logits / temp if temp != 1.0 else logits, dim=-1)
    picked = logps[torch.arange(len(forced)), torch.tensor(forced)].tolist()
    k = seq.req.top_logprobs
    tops: list[list[tuple[int, float]] | None] = [None] * len(forced)
    if k > 0:
        vals, idx = logps.topk(min(k, logps.shape[-1]), dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    assert n > 0
    for token, lp, top in zip(forced, picked, tops, strict=True):
        seq.append(token, lp, top)
    if seq.finish_reason is None:
        seq.finish_reason = "length"


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    # Padding rows to a common width is right for full attention only (Qwen3's layers without a sliding window).
    layers = list(cache.layers)
    if not all(type(layer) is DynamicLayer for layer in layers):
        raise ValueError("the transformers engine batches full-attention KV caches only")
    return layers  # type: ignore[return-value]


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class BatchKV:
    """The running sequences' KV caches as one left-padded batch, one row per sequence.

    Each layer holds keys and values of shape [rows, kv_heads, width, head_dim]; a row's context sits at the
    right end and ``mask`` (rows x width) marks it. A decode step appends one column for every row, so rows stay
    aligned; a row that joins is padded on the left (or pads the others), and columns that become padding in
    every row are trimmed when rows leave. Each row's query carries its own position id, so RoPE sees the true
    positions and the padding changes nothing but the cost.
    """

    rows: list[Seq]
    cache: DynamicCache | None
    mask: torch.Tensor

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.rows, self.cache, self.mask = [], None, torch.zeros(0, 0, dtype=torch.bool)

    def add(self, seq: Seq, cache: DynamicCache) -> None:
        length = cache.get_seq_length()
        if self.cache is None:
            self.cache, self.mask, self.rows = cache, torch.ones(1, length, dtype=torch.bool), [seq]
            return
        width = max(length, self.mask.shape[1])
        for mine, new in zip(_layers(self.cache), _layers(cache), strict=True):
            assert mine.keys is not None and mine.values is not None
            assert new.keys is not None and new.values is not None
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(new.keys, width, 2)])
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(new.values, width, 2)])
        row = torch.ones(1, length, dtype=torch.bool)
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(row, width, 1)])
        self.rows.append(seq)

    def drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self.rows) if s.finish_reason is None]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.clear()
            return
        assert self.cache is not None
        index = torch.tensor(keep)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(0).to(torch.int8).argmax())
        for layer in _layers(self.cache):
            assert layer.keys is not None and layer.values is not None
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self.mask = mask[:, start:]
        self.rows = [self.rows[i] for i in keep]

    def verify(self, model: PreTrainedModel, drafts: list[list[int]]) -> torch.Tensor:
        """One verification step: feeds each row's last token and its draft, padded to the longest, and
        returns logits [rows, 1 + longest draft, vocab]. ``keep`` must then say which columns stay."""
        width = 1 + max(len(d) for d in drafts)
        tokens = torch.tensor(
            [
                [s.output_ids[-1], *d, *[s.output_ids[-1]] * (width - 1 - len(d))]
                for s, d in zip(self.rows, drafts, strict=True)
            ]
        )
        positions = torch.tensor([[s.context_len - 1 + j for j in range(width)] for s in self.rows])
        self.mask = torch.cat([self.mask, torch.ones(len(self.rows), width, dtype=torch.bool)], dim=1)
        out = model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=positions,
            **with_cache(model, self.cache),
            use_cache=True,
        )
        return out.logits

    def keep(self, new_columns: list[int], width: int) -> None:
        """After ``verify`` appended ``width`` columns to every row, keep each row's first ``new_columns``
        (its last token and the drafted tokens it kept) and mask the rest; compact once most columns are
        masked, so a long run of rejected drafts costs neither memory nor attention."""
        for i, n in enumerate(new_columns):
            self.mask[i, self.mask.shape[1] - width + n :] = False
        used = int(self.mask.sum(1).max())
        if self.mask.shape[1] > 2 * used + 32:
            self._compact(used)

    def _compact(self, used: int) -> None:
        assert self.cache is not None
        rows = self.mask.shape[0]
        index = torch.zeros(rows, used, dtype=torch.long)
        mask = torch.zeros(rows, used, dtype=torch.bool)
        for i in range(rows):
            cols = self.mask[i].nonzero().flatten()
            index[i, used - len(cols) :] = cols
            mask[i, used - len(cols) :] = True
        for layer in _layers(self.cache):
            assert layer.keys is not None and layer.values is not None
            g = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, g)
            layer.values = layer.values.gather(2, g)
        self.mask = mask

    def step(self, model: PreTrainedModel) -> torch.Tensor:
        """One decode step for every row: feeds each row's last token, returns logits [rows, vocab]."""
        return self.verify(model, [[] for _ in self.rows])[:, -1]


def draw(probs: torch.Tensor, seqs: list[Seq]) -> list[int]:
    """One index per row of ``probs`` (unnormalised), by inverse CDF with one uniform from each row's generator:
    a single vectorised pass, several times faster than a ``torch.multinomial`` per row over a 150k vocabulary."""
    cdf = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=s.generator) for s in seqs])
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return picks[:, 0].clamp_(max=probs.shape[-1] - 1).tolist()


def sample(logits: torch.Tensor, seqs: list[Seq]) -> list[tuple[int, float]]:
    """A token per row with its log-probability under the temperature-scaled distribution (before top-p)."""
    return _sample(logits, seqs)[0]


def sample_with_top(
    logits: torch.Tensor, seqs: list[Seq]
) -> list[tuple[int, float, list[tuple[int, float]] | None]]:
    """``sample``, and for each row whose request asks for ``top_logprobs`` its most likely tokens under the
    same distribution (id and log-prob, best first); None for the other rows."""
    picks, logps = _sample(logits, seqs)
    k = max((s.req.top_logprobs for s in seqs), default=0)
    if k <= 0:
        return [(t, lp, None) for t, lp in picks]
    vals, idx = logps.topk(min(k, logps.shape[-1]), dim=-1)
    vals_l, idx_l = vals.tolist(), idx.tolist()
    out: list[tuple[int, float, list[tuple[int, float]] | None]] = []
    for i, ((t, lp), s) in enumerate(zip(picks, seqs, strict=True)):
        n = s.req.top_logprobs
        out.append((t, lp, list(zip(idx_l[i][:n], vals_l[i][:n], strict=True)) if n > 0 else None))
    return out


def _sample(logits: torch.Tensor, seqs: list[Seq]) -> tuple[list[tuple[int, float]], torch.Tensor]:
    temps = [s.req.temperature if s.req.temperature > 0 else 1.0 for s in seqs]
    # Passes over [rows, vocab] dominate a small model's step: skip those that change nothing.
    scaled = logits.float() if all(t == 1.0 for t in temps) else logits.float() / torch.tensor(temps)[:, None]
    logps = torch.log_softmax(scaled, dim=-1)
    greedy = any(s.req.temperature <= 0 for s in seqs)
    tokens = logits.argmax(dim=-1).tolist() if greedy else [0] * len(seqs)
    full = [i for i, s in enumerate(seqs) if s.req.temperature > 0 and s.req.top_p >= 1.0]
    if full:
        probs = logps.index_select(0, torch.tensor(full)).exp()
        for i, token in zip(full, draw(probs, [seqs[i] for i in full]), strict=True):
            tokens[i] = token
    for i, s in enumerate(seqs):
        if s.req.temperature > 0 and s.req.top_p < 1.0:
            head, order = nucleus(logps[i].exp(), s.req.top_p)
            tokens[i] = int(order[draw(head[None], [s])[0]])
    picked = logps[torch.arange(len(seqs)), torch.tensor(tokens)].tolist()
    return list(zip(tokens, picked, strict=True)), logps


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p: ``probs`` sorted, most likely first, with everything past the smallest head whose mass reaches
    ``top_p`` zeroed (unnormalised), and the order that sorted them."""
    head, order = probs.sort(descending=True)
    head[head.cumsum(0) - head >= top_p] = 0.0
    return head, order

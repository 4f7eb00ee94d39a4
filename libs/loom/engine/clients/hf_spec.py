"""Lossless speculative decoding for the transformers engine.

Drafts come from Loom's suffix-match drafter over two corpora: the request's own tokens (prompt and output)
and every request's output on this engine, bounded (so a GRPO group's siblings and, where the engine served
them, the prompt's earlier epochs draft for each other, as SGLang's n-gram cache does across requests). One
forward pass verifies every row's draft; each drafted token is kept by speculative sampling's rule for a
deterministic draft (Leviathan et al. 2023, Chen et al. 2023): with probability p(token) under the
distribution the request samples from, else the step ends with a token drawn from p with the drafted one
removed. A draft kept whole earns one more token from the last position. Each emitted token is therefore
distributed exactly as plain decoding's; under greedy decoding the tokens are the same ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from loom.engine.clients.hf_batch import Seq, draw, nucleus
from loom.speculative.drafter import MAX_N, MOST, Draft, Drafter, SuffixIndex, Tally

KEEP = 256  # outputs of finished requests kept as drafting corpus


@dataclass
class _Own:
    index: SuffixIndex
    drafter: Drafter
    shared_sid: int
    indexed: int = 0  # of prompt + output_ids, in ``index``
    shared_indexed: int = 0  # of output_ids, in the shared corpus


@dataclass
class Drafts:
    """Per-request drafting state and the engine-wide corpus of outputs."""

    most: int = MOST
    keep: int = KEEP
    shared: SuffixIndex = field(default_factory=SuffixIndex)
    stats: Tally = field(default_factory=Tally)
    _own: dict[str, _Own] = field(default_factory=dict)
    _done: list[list[int]] = field(default_factory=list)

    def draft(self, seq: Seq) -> Draft:
        """A draft for ``seq``'s next step, never past its token budget."""
        own = self._own.get(seq.req.rid)
        if own is None:
            index = SuffixIndex()
            index.add()
            own = _Own(index, Drafter([("own", index), ("engine", self.shared)]), self.shared.add())
            self._own[seq.req.rid] = own
        # Only what arrived since the last step is indexed; the own index's one sequence is the context.
        n = len(seq.prompt)
        if own.indexed < n:
            own.index.extend(0, seq.prompt[own.indexed :])
        own.index.extend(0, seq.output_ids[max(0, own.indexed - n) :])
        own.indexed = n + len(seq.output_ids)
        self.shared.extend(own.shared_sid, seq.output_ids[own.shared_indexed :])
        own.shared_indexed = len(seq.output_ids)
        room = seq.req.max_new_tokens - len(seq.output_ids) - 1
        d = own.drafter.draft(own.index.seqs[0][-MAX_N:])
        return Draft(d.tokens[: min(room, self.most)], d.source, d.rate)

    def feedback(self, seq: Seq, draft: Draft, kept: int) -> None:
        own = self._own.get(seq.req.rid)
        if own is not None:
            own.drafter.feedback(draft, kept)

    def retire(self, seq: Seq) -> None:
        """``seq`` is done: its output stays in the corpus; past ``keep`` finished outputs the corpus is rebuilt
        from the newest ones and the running requests'."""
        own = self._own.pop(seq.req.rid, None)
        if own is None:
            return
        self._done.append(list(seq.output_ids))
        if len(self._done) <= 2 * self.keep:
            return
        self._done = self._done[-self.keep :]
        self.shared = SuffixIndex()
        for out in self._done:
            self.shared.add(out)
        for o in self._own.values():
            o.shared_sid, o.shared_indexed = self.shared.add(), 0
            o.drafter.corpora[1] = ("engine", self.shared)


@dataclass
class StepCost:
    """An engine step's seconds against the positions it computes (rows x columns), a + b * positions, fitted
    by least squares over the latest ``window`` steps, plain and verifying alike."""

    window: int = 64
    _steps: deque[tuple[int, float]] = field(default_factory=deque)

    def observe(self, positions: int, seconds: float) -> None:
        self._steps.append((positions, seconds))
        if len(self._steps) > self.window:
            self._steps.popleft()

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before the steps seen vary enough in size to tell them apart."""
        if len(self._steps) < MIN_STEPS:
            return None
        xs = [float(x) for x, _ in self._steps]
        ys = [y for _, y in self._steps]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx < 1e-9 * len(xs) * max(1.0, mx * mx):
            return None
        b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
        return max(0.0, my - b * mx), b


MIN_STEPS = 8  # steps timed before their cost decides how wide a verification is


def paying_width(drafts: list[Draft], cost: tuple[float, float] | None) -> int:
    """How many drafted columns a verification over these rows should compute: each column costs every row
    one more position (the batch is padded to its widest draft), b * rows seconds, and earns the tokens its
    drafts are expected to keep (each row's j-th token with probability rate^j), each worth a plain step's
    seconds per token, (a + b * rows) / rows. The widest column that still earns its cost, in the widest
    draft when the cost is not known yet."""
    widest = max((len(d.tokens) for d in drafts), default=0)
    if cost is None or not drafts:
        return widest
    a, b = cost
    rows = len(drafts)
    per_token = (a + b * rows) / rows
    width = 0
    for j in range(1, widest + 1):
        earned = sum(d.rate**j for d in drafts if len(d.tokens) >= j)
        if earned * per_token < b * rows:
            break
        width = j
    return width


def verify_row(
    seq: Seq, draft: list[int], logits: torch.Tensor
) -> tuple[list[tuple[int, float, list[tuple[int, float]] | None]], int]:
    """The tokens one verification step emits for ``seq``, each with its log-prob and top alternatives, and
    how many of ``draft`` it kept. ``logits`` holds the model's logits after the row's last token and after
    each drafted token (len(draft) + 1 rows)."""
    req = seq.req
    temp = req.temperature if req.temperature > 0 else 1.0
    logps = torch.log_softmax(logits.float() / temp if temp != 1.0 else logits.float(), dim=-1)
    k = req.top_logprobs
    out: list[tuple[int, float, list[tuple[int, float]] | None]] = []

    def emit(j: int, token: int) -> None:
        top = None
        if k > 0:
            vals, idx = logps[j].topk(min(k, logps.shape[-1]))
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        out.append((token, float(logps[j, token]), top))

    for j, d in enumerate(draft):
        if req.temperature <= 0:
            best = int(logits[j].argmax())
            if best != d:
                emit(j, best)
                return out, j
            emit(j, d)
            continue
        p = _target(logps[j], req.top_p)
        u = float(torch.rand(1, generator=seq.generator))
        if u < float(p[d]):
            emit(j, d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        emit(j, draw(residual[None], [seq])[0])
        return out, j
    j = len(draft)
    if req.temperature <= 0:
        emit(j, int(logits[j].argmax()))
    else:
        emit(j, draw(_target(logps[j], req.top_p)[None], [seq])[0])
    return out, len(draft)


def _target(logps: torch.Tensor, top_p: float) -> torch.Tensor:
    """What plain decoding samples from at one position: the temperature-scaled distribution, cut to its
    nucleus under top-p, normalised."""
    p = logps.exp()
    if top_p < 1.0:
        head, order = nucleus(p, top_p)
        p = torch.zeros_like(p).scatter_(0, order, head)
    return p / p.sum()

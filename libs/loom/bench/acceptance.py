"""How many drafted tokens a model would accept, measured on recorded trajectories.

Each recorded call's text, tokenised with the Qwen tokenizer, is replayed as decoding: at every step the
drafter proposes a continuation of everything the trajectory holds so far, the step keeps the drafted tokens
that equal the recorded ones up to the first that differs, plus one token of its own. The texts were sampled
from a model, so the share kept estimates the acceptance probability of a deterministic draft under lossless
speculative sampling at the temperature they were sampled at.

Draft sources: the trajectory's own context (its task, calls and observations so far), its group's siblings
(their calls so far: the turns before this one whole, this turn up to as many tokens as this sample has
made), the same task's earlier epoch (its calls, whole) and a bounded corpus of other tasks' calls. Trials of
one prompt split into an earlier epoch (the first ``HISTORY_TRIALS``) and a group (the rest).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loom.data.trace_sets import trace_set
from loom.data.traces import Trace, prompt_of
from loom.speculative.drafter import MAX_N, Drafter, SuffixIndex, Tally
from loom.text.tokenizer import IM_END, qwen_tokenizer

SOURCES = ("own", "siblings", "history", "corpus")
HISTORY_TRIALS = 2
CORPUS = 16  # other tasks' samples whose calls every sample may draft from


@dataclass(frozen=True)
class Turn:
    output: tuple[int, ...]  # the call, ended by <|im_end|>
    observation: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    id: str
    prompt: str
    context: tuple[int, ...]
    turns: tuple[Turn, ...]


def tokenised(traces: Sequence[Trace]) -> list[Sample]:
    enc = qwen_tokenizer()
    return [
        Sample(
            t.id,
            prompt_of(t),
            tuple(enc.encode_ordinary(t.task)),
            tuple(
                Turn((*enc.encode_ordinary(s.action), IM_END), tuple(enc.encode_ordinary(s.observation)))
                for s in t.steps
            ),
        )
        for t in traces
    ]


@dataclass(frozen=True)
class Case:
    """One sample to replay and what it may draft from."""

    target: Sample
    siblings: tuple[Sample, ...]
    history: tuple[Sample, ...]
    corpus: tuple[Sample, ...]


def cases(samples: Sequence[Sample], prompts: int | None = None) -> list[Case]:
    """Every group member of the first ``prompts`` prompts (all by default), in order, with its siblings,
    its prompt's earlier epoch and the ``CORPUS`` samples of other prompts before it."""
    by_prompt: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_prompt[s.prompt].append(s)
    chosen = list(by_prompt)[:prompts]
    out: list[Case] = []
    seen: list[Sample] = []
    for p in chosen:
        trials = by_prompt[p]
        history, group = (
            (trials[:HISTORY_TRIALS], trials[HISTORY_TRIALS:]) if len(trials) > 2 else ([], trials)
        )
        corpus = tuple(seen[-CORPUS:])
        for s in group:
            out.append(Case(s, tuple(g for g in group if g is not s), tuple(history), corpus))
        seen += group
    return out


def replay(case: Case, use: Sequence[str], fixed: int | None = None) -> Tally:
    """Decode ``case.target``'s calls with drafts from the sources in ``use`` (in order of preference)."""
    unknown = set(use) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown draft sources {sorted(unknown)}; known: {', '.join(SOURCES)}")
    own, sibs, hist, corp = SuffixIndex(), SuffixIndex(), SuffixIndex(), SuffixIndex()
    me = own.add(case.target.context)
    for s in case.history if "history" in use else ():
        for t in s.turns:
            hist.add(t.output)
    for s in case.corpus if "corpus" in use else ():
        for t in s.turns:
            corp.add(t.output)
    named = {"own": own, "siblings": sibs, "history": hist, "corpus": corp}
    drafter = Drafter([(u, named[u]) for u in use], fixed)
    siblings = case.siblings if "siblings" in use else ()
    # For each sibling, the sequence of its current turn in ``sibs`` and how much of it is fed.
    growing: list[tuple[int, int]] = [(-1, 0)] * len(siblings)
    tally = Tally()
    for n, turn in enumerate(case.target.turns):
        for j, s in enumerate(siblings):
            sid, fed = growing[j]
            if sid >= 0:
                sibs.extend(sid, s.turns[n - 1].output[fed:])
            growing[j] = (sibs.add(), 0) if n < len(s.turns) else (-1, 0)
        out, i = turn.output, 0
        while i < len(out):
            for j, s in enumerate(siblings):
                sid, fed = growing[j]
                upto = min(i, len(s.turns[n].output)) if sid >= 0 else fed
                if fed < upto:
                    sibs.extend(sid, s.turns[n].output[fed:upto])
                    growing[j] = (sid, upto)
            draft = drafter.draft(own.seqs[me][-MAX_N:])
            kept = 0
            while kept < len(draft.tokens) and i + kept < len(out) and draft.tokens[kept] == out[i + kept]:
                kept += 1
            made = min(kept + 1, len(out) - i)
            tally.record(len(draft.tokens), kept)
            drafter.feedback(draft, kept)
            own.extend(me, out[i : i + made])
            i += made
        tally.tokens += len(out)
        own.extend(me, turn.observation)
    return tally


def measure(
    chosen: Sequence[Case], use: Sequence[str], fixed: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """Replay every case; totals, accepted tokens per verification step with a 95% interval (bootstrap over
    prompts, whose samples are not independent), and the distribution of kept tokens."""
    per_prompt: dict[str, Tally] = defaultdict(Tally)
    for c in chosen:
        per_prompt[c.target.prompt].add(replay(c, use, fixed))
    total = Tally()
    for t in per_prompt.values():
        total.add(t)
    tallies = list(per_prompt.values())
    rng = random.Random(seed)
    boot = []
    for _ in range(1000):
        pick = [tallies[rng.randrange(len(tallies))] for _ in tallies]
        steps = sum(t.steps for t in pick)
        boot.append(sum(t.accepted for t in pick) / steps if steps else 0.0)
    boot.sort()
    steps = max(1, total.steps)
    return {
        "sources": list(use),
        "draft_length": "adaptive" if fixed is None else fixed,
        "prompts": len(tallies),
        "samples": len(chosen),
        "tokens": total.tokens,
        "steps": total.steps,
        "accepted_per_step": total.accepted / steps,
        "accepted_per_step_ci95": [boot[24], boot[974]],
        "tokens_per_step": total.tokens / steps,
        "acceptance_rate": total.accepted / total.drafted if total.drafted else 0.0,
        "draft_rate": total.drafting_steps / steps,
        "kept_distribution": {str(k): v / steps for k, v in sorted(total.kept.items())},
    }


def workload_cases(workload: str, prompts: int | None = None) -> list[Case]:
    return cases(tokenised(trace_set(workload)), prompts)

"""A Loom trajectory as one verl sample (what verl's ``AgentLoopOutput`` holds, before padding).

A trajectory is one sequence (``loom.trainer.grpo.flatten``): the prompt is its first call's context; the
response is everything after it, the model's tokens as the engine produced them (``response_mask`` 1, their
sampling log-probabilities in ``response_logprobs``) and the environment's as Loom appended them (mask 0,
log-probability 0, as verl's tool agent loop leaves its tool responses), never decoded and encoded again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loom.protocol import Trajectory
from loom.text.tokenizer import ENDOFTEXT
from loom.trainer.grpo import flatten


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    # Loom's reward; a sample with nothing to train on scores 0 with every token masked.
    score: float
    # verl's count: the user's message, then each call's answer and the environment's reply between them.
    num_turns: int
    # The weights that made it, as Loom reports them ("2"; "1,2" when the fleet moved mid-trajectory) and as
    # verl's trainer reads them (the first and last global step, when the versions are verl's steps).
    weight_version: str
    min_global_steps: int | None
    max_global_steps: int | None
    status: str
    # "job/trajectory": a trajectory id is its job's own.
    traj_id: str

    def fit(self, prompt_length: int, response_length: int) -> Sample:
        """Cut to verl's widths as its agent loops do: the prompt's oldest tokens, the response's last ones."""
        n = response_length
        return replace(
            self,
            prompt_ids=self.prompt_ids[-prompt_length:],
            response_ids=self.response_ids[:n],
            response_mask=self.response_mask[:n],
            response_logprobs=self.response_logprobs[:n],
        )


def sample_of(traj: Trajectory) -> Sample:
    """A trajectory as verl's sample. One that cannot be trained on (failed, aborted, unscored, or without
    token ids) keeps its place with its prompt, one masked pad token and a score of 0."""
    # An engine that never moved reports its starting weights as "" (simulated) or "0" (transformers).
    versions = sorted({s.weight_version or "0" for s in traj.steps}, key=lambda v: (len(v), v))
    numeric = [int(v) for v in versions if v.isdigit()]
    steps = (min(numeric), max(numeric)) if numeric and len(numeric) == len(versions) else (None, None)
    try:
        flat = flatten(traj) if traj.status == "completed" and traj.reward is not None else None
    except ValueError:
        flat = None
    first = traj.steps[0].prompt_ids if traj.steps else None
    if flat is None or not first:
        prompt, response, mask, lps, score = list(first or [ENDOFTEXT]), [ENDOFTEXT], [0], [0.0], 0.0
    else:
        n = len(first)
        ids, loss_mask = flat.ids.tolist(), flat.loss_mask.tolist()
        prompt, response, mask = ids[:n], ids[n:], [int(m) for m in loss_mask[n:]]
        lps, score = flat.behaviour_logprobs.tolist()[n:], float(traj.reward or 0.0)
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=lps,
        score=score,
        num_turns=2 * len(traj.steps),
        weight_version=",".join(versions),
        min_global_steps=steps[0],
        max_global_steps=steps[1],
        status=traj.status,
        traj_id=f"{traj.job_id}/{traj.traj_id}",
    )

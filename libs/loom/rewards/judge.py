"""LLM-as-judge reward: a grading prompt goes through the router to an engine like any generation, and the
grade is parsed from the reply (``Score: 7``, ``[[7]]``, ``7/10``), scaled to [0, 1]."""

from __future__ import annotations

import re

from loom.protocol import GenRequest, RewardRequest
from loom.rewards.context import RewardContext, RewardError, ground_truth, response_text
from loom.runtime.genclient import GenClient
from loom.text.tokenizer import qwen_tokenizer

PROMPT = """You are a strict grader. Judge whether the answer solves the question{ref_clause}.
Think briefly, then end with a line "Score: N" where N is an integer from 0 (wrong) to {scale} (fully correct).

Question:
{question}
{reference}
Answer:
{answer}

Grade:"""

_SCORE = [
    re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?", re.I),
    re.compile(r"\[\[\s*(-?\d+(?:\.\d+)?)\s*\]\]"),
    re.compile(r"(?:rating|grade)\s*[:=]\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+(?:\.\d+)?))?", re.I),
]


def parse_score(text: str, scale: float = 10.0) -> float:
    """The judge's grade in [0, 1]; RewardError when the reply states none or one out of range."""
    for pat in _SCORE:
        found = list(pat.finditer(text))
        if found:
            m = found[-1]
            out_of = float(m.group(2)) if m.lastindex and m.lastindex >= 2 and m.group(2) else scale
            value = float(m.group(1))
            if out_of <= 0 or not 0 <= value <= out_of:
                raise RewardError(f"judge grade {value} is outside 0..{out_of:g}")
            return value / out_of
    raise RewardError(f"judge reply states no score: {text[-200:]!r}")


def judge_prompt(question: str, answer: str, reference: str | None, scale: int = 10) -> str:
    return PROMPT.format(
        question=question.strip(),
        answer=answer.strip(),
        reference=f"\nReference answer:\n{reference.strip()}\n" if reference else "",
        ref_clause=", using the reference answer" if reference else "",
        scale=scale,
    )


async def judge_reward(req: RewardRequest, ctx: RewardContext) -> float:
    if ctx.nc is None:
        raise RewardError("the judge needs a bus connection to reach the router")
    traj = req.trajectory
    question = req.params.get("question") or (req.task.data.get("prompt") if req.task else None)
    if not isinstance(question, str):
        raise RewardError(f"trajectory {traj.traj_id}: the judge needs the task's question")
    try:
        ref = ground_truth(req)
        reference = ref if isinstance(ref, str) else None
    except RewardError:
        reference = None
    scale = int(req.params.get("judge_scale", 10))
    tok = qwen_tokenizer()
    ids = tok.encode(judge_prompt(question, response_text(traj), reference, scale), disallowed_special=())
    gen = GenRequest(
        rid=f"judge.{traj.job_id}.{traj.traj_id}",
        # A job of its own for the router: the judge's calls are not steps of the trajectory they grade.
        job_id=f"judge-{traj.job_id}",
        traj_id=traj.traj_id,
        step=0,
        input_len=len(ids),
        max_new_tokens=int(req.params.get("judge_max_tokens", 512)),
        input_ids=ids,
    )
    res = await GenClient(ctx.nc, give_up_s=float(req.params.get("judge_timeout_s", 120))).generate(gen)
    if res.output_ids is None:
        raise RewardError(
            f"engine of worker {res.worker_id} returned {res.output_len} tokens but no text: "
            "a lengths-only (simulated) engine cannot judge"
        )
    return parse_score(tok.decode(res.output_ids), scale)

"""slime's own code writing its rollout dump (``--save-debug-rollout-data``), run as a script with a slime
checkout on the path: ``PYTHONPATH=SLIME_SRC python -m tests.slime.slime_dump OUT_TEMPLATE``.

slime is not on PyPI (the name there is another project), so CI cannot install it: the dumps in
``tests/slime/rollouts`` were written by this script against slime 624b824 (2026-08-21), and
``test_slime_rollout_dump`` writes them again and compares where ``LOOM_SLIME_SRC`` names a checkout.

Two rollouts of two prompts, three samples each, built as slime's multi-turn generate functions build them
(``examples/search-r1/generate_with_search.py``): the prompt's ids, then per call ``append_response_tokens``
with the output, its log probabilities and SGLang's ``meta_info`` (finish reason, cached and prompt tokens,
weight version), and each tool's reply as untrainable tokens; ``non_generation_time`` the seconds the tools
took; then ``save_debug_rollout_data`` for the rollout, and once for an evaluation. Prints, as JSON, what was
written: per sample its rollout, prompt index, (context, output) per call and tool seconds."""

from __future__ import annotations

import json
import sys

from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.utils.types import Sample

from loom.text import chat

PROMPTS = ["What is 17 * 3? Use the calculator.", "Find the capital of France with the search tool."]
GROUP = 3
ARGS = None  # append_response_tokens reads args only for speculative decoding's statistics


def _sample(rollout: int, prompt: int, k: int) -> tuple[Sample, dict[str, object]]:
    text = chat.render([{"role": "user", "content": PROMPTS[prompt]}])
    ids = chat.encode(text)
    s = Sample(group_index=prompt, index=prompt * GROUP + k, prompt=text, tokens=list(ids))
    calls, tool_s = [], []
    n = 1 + (k + rollout) % 3  # one to three calls
    for call in range(n):
        if call:
            reply = chat.encode("<tool_response>" + " ok" * (4 + call + k) + "</tool_response>")
            s.append_response_tokens(ARGS, tokens=reply, trainable=False)
            tool_s.append(0.25 * (call + k))
        out = chat.encode(
            "<think>" + " step" * (3 + 2 * k + call + rollout) + "</think><tool_call>{}</tool_call>"
        )
        calls.append((len(s.tokens), len(out)))
        last = call == n - 1
        finish = ("length" if k == 2 else "stop") if last else "stop"
        meta = {
            "finish_reason": {"type": finish},
            "prompt_tokens": len(s.tokens),
            "cached_tokens": len(ids) if call else 0,
            "completion_tokens": len(out),
            "weight_version": str(rollout),
        }
        s.append_response_tokens(ARGS, tokens=out, log_probs=[-0.5] * len(out), meta_info=meta)
    s.response = "".join(chat.decode(s.tokens[len(ids) :]))
    s.non_generation_time = sum(tool_s)
    s.reward = float(k % 2)
    return s, {
        "rollout": rollout,
        "prompt": prompt,
        "calls": calls,
        "env_s": sum(tool_s),
        "status": s.status.value,
    }


if __name__ == "__main__":
    template = sys.argv[1]
    written = []
    for rollout in (1, 2):
        samples = []
        for prompt in range(len(PROMPTS)):
            for k in range(GROUP):
                s, row = _sample(rollout, prompt, k)
                samples.append(s)
                written.append(row)
        save_debug_rollout_data(template, samples, rollout_id=rollout, evaluation=False)
    # An evaluation's dump, which is not a training rollout: ``{"name": {"samples": [...]}}``.
    save_debug_rollout_data(template, {"math": {"samples": samples[:2]}}, rollout_id=2, evaluation=True)
    print(json.dumps(written))

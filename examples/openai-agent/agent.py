"""An agent written against the OpenAI API, run through Loom's gateway with nothing but the `openai` package.

It submits an external job (or drives one given with --job), then drives every session at once: a chat turn
with a calculator tool, the tool's result (or a nudge when the model made no call), a second, streamed
turn, and finish with a reward (1 when the final reply holds the right sum). It prints one JSON line.

    python examples/openai-agent/agent.py --api http://127.0.0.1:8080 --token "$(cat .loom/api_token)" --tasks 8
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
from typing import Any

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of numbers, + and -.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub}


def calculate(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers, + and -")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"error: {e}"


async def drive(session: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    # The session's own key: the agent never holds the tenant's token.
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=2)
    task = session["task"]["data"]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the calculator, then answer with the number."},
        {"role": "user", "content": task["question"]},
    ]
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=max_tokens, logprobs=True
    )
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        args = json.loads(call.function.arguments or "{}")
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": calculate(str(args.get("expression")))}
        )
    if not reply.tool_calls:
        messages.append({"role": "user", "content": "Please use the calculator."})
    answer = ""
    stream = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, max_tokens=max_tokens, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            answer += choice.delta.content or ""
    reward = float(str(task["answer"]) in answer)
    await client.post("/finish", body={"reward": reward}, cast_to=object)
    return {"traj_id": session["traj_id"], "tool_calls": len(reply.tool_calls or []), "reward": reward}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", required=True, help="Loom's API, e.g. http://127.0.0.1:8080")
    p.add_argument("--token", required=True, help="an API token of your tenant")
    p.add_argument("--job", help="drive this external job instead of submitting one")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    api = openai.AsyncOpenAI(base_url=f"{args.api.rstrip('/')}/v1", api_key=args.token)
    job_id = args.job
    if job_id is None:
        tasks = [
            {"id": f"sum{i}", "data": {"question": f"What is {i} + {2 * i}?", "answer": 3 * i}}
            for i in range(args.tasks)
        ]
        spec = {"env": "external", "tasks": tasks, "group_size": args.group_size, "session_idle_s": 120}
        job_id = (await api.post("/jobs", body=spec, cast_to=dict))["id"]
    sessions = (await api.get(f"/jobs/{job_id}/sessions", cast_to=dict))["sessions"]
    runs = await asyncio.gather(*(drive(s, args.max_tokens) for s in sessions))
    print(
        json.dumps(
            {
                "job": job_id,
                "sessions": len(runs),
                "tool_calls": sum(r["tool_calls"] for r in runs),
                "mean_reward": sum(r["reward"] for r in runs) / max(1, len(runs)),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())

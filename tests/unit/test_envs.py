"""Environments without sandboxes: action parsing, BM25, answers, reference scripts, backoff."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.envs import actions, hotpotqa, tasksets
from loom.envs.bm25 import BM25, tokens
from loom.envs.math_env import MathEnv, same_answer
from loom.envs.search_env import SearchEnv, index
from services.envmgr.env_loop import backoff_s
from tests.conftest import need_shared


def test_parse_react_json_and_errors() -> None:
    assert actions.parse("Thought 2: next.\nAction 2: Search[Pete Doherty]") == actions.ToolCall(
        "Search", {"input": "Pete Doherty"}
    )
    call = actions.parse(
        'I will run it.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    )
    assert call.name == "python" and call.arguments == {"code": "print(1)"}
    assert actions.parse('{"name": "submit", "arguments": "{\\"code\\": \\"x\\"}"}').arguments == {
        "code": "x"
    }
    assert actions.parse(actions.json_call("python", code="a[1]")).arguments == {"code": "a[1]"}
    for bad in ("just thinking", "<tool_call>{not json}</tool_call>", '{"arguments": {}}'):
        with pytest.raises(actions.ParseError):
            actions.parse(bad)


words = st.sampled_from(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta"])
docs_st = st.lists(st.lists(words, min_size=1, max_size=12).map(" ".join), min_size=1, max_size=15)


@settings(max_examples=80, deadline=None)
@given(docs_st, st.lists(words, min_size=1, max_size=4).map(" ".join))
def test_bm25_index_matches_brute_force_scoring(docs: list[str], query: str) -> None:
    bm = BM25(docs)
    n, avg = len(docs), sum(len(tokens(d)) for d in docs) / len(docs)

    def brute(d: str) -> float:
        toks = tokens(d)
        s = 0.0
        for t in set(tokens(query)):
            df = sum(1 for x in docs if t in tokens(x))
            tf = toks.count(t)
            if tf:
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                s += idf * tf * 2.5 / (tf + 1.5 * (0.25 + 0.75 * len(toks) / avg))
        return s

    expected = {i: brute(d) for i, d in enumerate(docs) if brute(d) > 0}
    got = bm.scores(query)
    assert set(got) == set(expected)
    assert all(math.isclose(got[i], expected[i], rel_tol=1e-9) for i in got)
    top = bm.top(query, 3)
    assert [s for _, s in top] == sorted((s for s in got.values()), reverse=True)[: len(top)]


@given(st.integers(0, 30))
def test_backoff_is_jittered_and_capped(attempt: int) -> None:
    x = backoff_s(attempt, base=0.2, cap=5.0)
    assert 0.0 <= x <= min(5.0, 0.2 * 2**attempt)


def test_numeric_answers() -> None:
    assert same_answer("The answer is $1,234.", "1234")
    assert same_answer("0.50", "1/2") and not same_answer("12", "13") and not same_answer("none", "1")


def test_every_gsm8k_reference_script_ends_with_the_gold_answer() -> None:
    need_shared("data/tasks/gsm8k-test.jsonl")
    tasks = tasksets.gsm8k()
    assert len(tasks) == 1319
    for t in tasks.values():
        script = MathEnv(t, sandbox=None).reference_actions()  # type: ignore[arg-type]
        final = actions.parse(script[-1])
        assert final.name == "Finish" and same_answer(final.arguments["input"], t.answer)
        assert all(actions.parse(a).name == "python" for a in script[:-1])


def test_search_env_replays_a_correct_run_to_exact_match() -> None:
    need_shared("data/traces/hotpotqa-react-100q-5trials.txt.gz")
    idx = index(None)
    scripted = [q for q in hotpotqa.load().questions if q.reference]
    assert len(scripted) >= 30

    async def episode(q: hotpotqa.QA) -> bool:
        env = SearchEnv(q, idx)
        await env.reset()
        for a in env.reference_actions():
            obs = await env.step(actions.parse(a))
            if obs.done:
                break
        return bool(env.verdict()["em"])

    results = [asyncio.run(episode(q)) for q in scripted]
    assert all(results), results
    env = SearchEnv(scripted[0], idx)
    miss = asyncio.run(env.step(actions.ToolCall("Search", {"input": "zzz no such page"})))
    assert miss.text.startswith("Could not find") and not miss.done

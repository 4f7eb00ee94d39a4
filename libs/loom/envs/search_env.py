"""``search``: HotpotQA with a local Wikipedia corpus. Tools as in ReAct: ``Search[entity]`` (the
paragraph of the best-matching article, or similar titles), ``Lookup[keyword]`` (the next sentence of
the current article containing it), ``Finish[answer]`` (exact match with the gold answer decides)."""

from __future__ import annotations

import functools
import re
from typing import Any

from loom.envs import hotpotqa
from loom.envs.actions import ToolCall
from loom.envs.base import Observation, clip, unknown_tool
from loom.envs.bm25 import BM25

TOOLS = ("Search", "Lookup", "Finish")
SYSTEM = (
    "Solve a question answering task with interleaving Thought, Action, Observation steps. Action can be "
    "Search[entity], which searches the entity on Wikipedia and returns the first paragraph if it exists, "
    "else similar entities; Lookup[keyword], which returns the next sentence containing keyword in the "
    "current passage; or Finish[answer], which returns the answer and finishes the task.\n"
)


class SearchIndex:
    def __init__(self, corpus: hotpotqa.Corpus) -> None:
        self.docs = corpus.docs
        self.by_title = {hotpotqa.normalize(d.title): d for d in corpus.docs}
        self.bm25 = BM25([f"{d.title} {d.title} {d.text}" for d in corpus.docs])

    def search(self, query: str) -> tuple[hotpotqa.Doc | None, list[str]]:
        """The article titled ``query``, or BM25's five best titles, as ReAct's Wikipedia tool answered."""
        exact = self.by_title.get(hotpotqa.normalize(query))
        if exact is not None:
            return exact, []
        return None, [self.docs[i].title for i, _ in self.bm25.top(query, 5)]


@functools.cache
def index(path: str | None = None) -> SearchIndex:
    return SearchIndex(hotpotqa.load(path))


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]


def reference_actions(qa: hotpotqa.QA) -> list[str]:
    """The actions of a correct ReAct run of the question, from the logs."""
    if not qa.reference:
        raise ValueError(f"{qa.id} has no correct run in the logs to script actions from")
    return [f"Thought {k + 1}: next step.\nAction {k + 1}: {a}" for k, a in enumerate(qa.reference)]


class SearchEnv:
    name = "search"

    def __init__(self, qa: hotpotqa.QA, idx: SearchIndex) -> None:
        self.qa = qa
        self.idx = idx
        self.page: hotpotqa.Doc | None = None
        self.lookup: tuple[str, int] = ("", 0)
        self.result: dict[str, Any] = {"score": 0.0, "em": False, "answer": None}

    async def reset(self) -> str:
        return f"{SYSTEM}\nQuestion: {self.qa.question}\n"

    async def step(self, call: ToolCall) -> Observation:
        arg = str(call.arguments.get("input", call.arguments.get("query", call.arguments.get("answer", ""))))
        name = call.name.capitalize()
        if name == "Search":
            doc, similar = self.idx.search(arg)
            if doc is None:
                return Observation(f"Could not find [{arg}]. Similar: {similar}")
            self.page, self.lookup = doc, ("", 0)
            return Observation(clip(doc.text))
        if name == "Lookup":
            if self.page is None:
                return Observation("Search an article first.")
            hits = [s for s in sentences(self.page.text) if arg.lower() in s.lower()]
            k = self.lookup[1] if self.lookup[0] == arg else 0
            self.lookup = (arg, k + 1)
            if k >= len(hits):
                return Observation("No more results.")
            return Observation(f"(Result {k + 1} / {len(hits)}) {hits[k]}")
        if name == "Finish":
            em = hotpotqa.exact_match(arg, self.qa.answer)
            self.result = {"score": float(em), "em": em, "answer": arg}
            return Observation(f"Episode finished, answer {arg!r}.", done=True)
        return unknown_tool(call, TOOLS)

    def reference_actions(self) -> list[str]:
        return reference_actions(self.qa)

    def verdict(self) -> dict[str, Any]:
        return dict(self.result)

    async def close(self) -> None:
        pass

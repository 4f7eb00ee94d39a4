"""Recorded agent trajectories from ``../shared/data/traces`` (the SWE-bench schema in data/README.md)."""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loom.settings import default_shared_dir

SWE_TRACES = "data/traces/swe-gemini3pro.jsonl.gz"


@dataclass(frozen=True)
class TraceStep:
    prompt_tokens: int
    completion_tokens: int
    action: str
    observation: str
    created: int
    # What answered the call: "tool" or "user" (a simulated user) where the trace set says; "" after the last.
    env: str = ""


@dataclass(frozen=True)
class Trace:
    id: str
    resolved: bool
    exit_status: str
    steps: tuple[TraceStep, ...]
    # The task statement the agent was given (the prompt after the system message).
    task: str = ""

    @property
    def total_completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.steps)


def prompt_of(trace: Trace) -> str:
    """The prompt a trajectory answered: trials of one prompt share the id up to ``#trial``."""
    return prompt_id(trace.id)


def prompt_id(trace_id: str) -> str:
    """The prompt of the recorded trajectory ``trace_id`` (its id up to ``#trial``)."""
    return trace_id.split("#", 1)[0]


def default_swe_path() -> Path:
    return default_shared_dir() / SWE_TRACES


# Reflexion's ReAct logs of HotpotQA: the search traces (loom.data.trace_sets) and the search environment's questions
# and corpus (loom.envs.hotpotqa) both read them.
HOTPOTQA_LOGS = default_shared_dir() / "data" / "traces" / "hotpotqa-react-100q-5trials.txt.gz"


def open_text(path: Path) -> TextIO:
    """A data file as UTF-8 text, gzip-compressed (``.gz``) or not."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


class TraceError(ValueError):
    pass


@functools.lru_cache(maxsize=4)
def load_traces(path: str | Path | None = None) -> dict[str, Trace]:
    """Load a JSONL(.gz) trace file of the SWE schema, keyed by trajectory id, in file order."""
    p = Path(path) if path is not None else default_swe_path()
    if not p.exists():
        raise TraceError(f"trace file not found: {p} (expected ../shared/data beside the project)")
    out: dict[str, Trace] = {}
    with open_text(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                steps = tuple(
                    TraceStep(
                        prompt_tokens=int(s["prompt_tokens"]),
                        completion_tokens=max(1, int(s["completion_tokens"])),
                        action=s.get("action") or "",
                        observation=s.get("observation") or "",
                        created=int(s.get("created") or 0),
                    )
                    for s in d["steps"]
                )
                out[str(d["id"])] = Trace(
                    id=str(d["id"]),
                    resolved=bool(d.get("resolved")),
                    exit_status=str(d.get("exit_status") or ""),
                    steps=steps,
                    task=str(d.get("task") or ""),
                )
            except (KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{p}:{lineno}: not a trace of the SWE schema: {e}") from e
    if not out:
        raise TraceError(f"{p}: no trajectories")
    return out

"""What every trainer integration does with Loom's REST edge: check an answer, and collect a finished job's
trajectories by (group, sample), all of them or an error. The TRL integration calls it synchronously (TRL's
``rollout_func`` is a plain function), verl's from its event loop; the HTTP calls are theirs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import httpx

from loom.protocol import Trajectory, from_json


def connect(url: str, token: str) -> httpx.AsyncClient:
    """An async client of Loom's REST edge at ``url`` with ``token``."""
    return httpx.AsyncClient(base_url=url, timeout=60.0, headers={"Authorization": f"Bearer {token}"})


def checked(r: httpx.Response) -> Any:
    """The answer's JSON; an answer of 400 or more as a RuntimeError that says what Loom said."""
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except (ValueError, json.JSONDecodeError):
            detail = r.text
        raise RuntimeError(f"Loom answered {r.status_code}: {detail}")
    return r.json()


def collect(
    job: dict[str, Any], spec: dict[str, Any], lines: Iterable[str]
) -> dict[tuple[int, int], Trajectory]:
    """The trajectories of ``job`` (``lines``: its NDJSON) by (group, sample); every slot of ``spec`` must
    have one."""
    trajs: dict[tuple[int, int], Trajectory] = {}
    for line in lines:
        if line:
            t = from_json(line, Trajectory)
            trajs[(t.group, t.sample)] = t
    missing = [k for k in slots(spec) if k not in trajs]
    if missing:
        raise RuntimeError(f"Loom job {job['id']} ({job['state']}) returned no trajectory for {missing[:4]}")
    return trajs


def slots(spec: dict[str, Any]) -> list[tuple[int, int]]:
    """A job's trajectories, (group, sample), in order."""
    return [(g, s) for g in range(len(spec["tasks"])) for s in range(spec["group_size"])]

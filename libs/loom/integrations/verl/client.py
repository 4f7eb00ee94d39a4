"""Loom's REST edge as verl's rollout uses it: run a job to the end and read its trajectories back (the fleet
moves through ``loom.integrations.fleet``). Async, since verl's agent loops run on an event loop (its manager does too)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx

from loom.integrations.jobs import checked, collect
from loom.protocol import Trajectory
from loom.protocol.messages import TERMINAL_JOB_STATES


async def run_job(
    http: httpx.AsyncClient, spec: dict[str, Any], timeout_s: float
) -> dict[tuple[int, int], Trajectory]:
    """Submit the job, wait for it, and return its trajectories by (group, sample); every one must be there.
    Cancelled (verl stopping, a timeout), it cancels the job in Loom too, so that its trajectories stop."""
    job = checked(await http.post("/v1/jobs", json=spec))
    try:
        deadline = time.monotonic() + timeout_s
        while job["state"] not in TERMINAL_JOB_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Loom job {job['id']} did not finish in {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
            job = checked(await http.get(f"/v1/jobs/{job['id']}"))
    except BaseException:
        with contextlib.suppress(httpx.HTTPError):
            await asyncio.shield(http.delete(f"/v1/jobs/{job['id']}"))
        raise
    url = f"/v1/jobs/{job['id']}/trajectories"
    async with http.stream("GET", url, params={"format": "ndjson"}) as r:
        if r.status_code >= 400:
            await r.aread()
            checked(r)
        return collect(job, spec, [line async for line in r.aiter_lines()])

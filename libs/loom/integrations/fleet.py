"""Moving a fleet through Loom's REST edge (``POST /v1/models/{model}/weights``), by any transport: what a
trainer integration calls once its main process holds the whole model (TRL's ``rollout_func``, verl's
checkpoint manager). The trainer stages the version (``loom.weights.publish``), then delivers it while the
scheduler moves the fleet, all or nothing.

Loom moves a fleet forward only: a version the fleet already serves, or has passed (another trainer process,
a restarted run), is not an error; the call says where the fleet is.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

from loom.integrations.jobs import checked
from loom.protocol import WeightsRef, to_builtins
from loom.weights.publish import Transport, Weights, deliver_during

log = logging.getLogger(__name__)


class _Behind(Exception):
    """The fleet already serves this version or a later one."""


async def fleet_version(http: httpx.AsyncClient, model: str) -> int:
    """The version the fleet of ``model`` serves (0: its start)."""
    r = await http.get(f"/v1/models/{model}/weights")
    if r.status_code == 404:
        return 0
    version = str(checked(r)["version"])
    return int(version) if version.isdigit() else 0


def _body(ref: WeightsRef) -> dict[str, Any]:
    out: dict[str, Any] = to_builtins(ref)
    for per_worker in ("rank", "world_size"):  # the scheduler's to set
        out.pop(per_worker, None)
    return out


async def push(
    http: httpx.AsyncClient,
    model: str,
    version: int,
    weights: Weights | str | Path,
    transport: Transport | None = None,
    timeout_s: float = 600.0,
) -> int:
    """Move every worker of ``model`` to ``version``: ``weights`` a checkpoint directory every worker reads, or
    the model (or its whole state dict) sent by ``transport``. The version the fleet serves after."""
    body: dict[str, Any] = {"version": version, "timeout_s": timeout_s}
    if isinstance(weights, str | Path):
        body["path"] = str(weights)
        try:
            await _post(http, model, body, timeout_s)
        except _Behind:
            return await _served(http, model, version)
        return version
    if transport is None:
        raise ValueError("moving a model's weights needs a transport (loom.weights.publish.transport)")
    ref = await transport.stage(version, weights)
    body["weights"] = _body(ref)
    body["async_fetch"] = transport.while_generating
    try:
        await deliver_during(transport, ref, timeout_s, _post(http, model, body, timeout_s))
    except _Behind:
        return await _served(http, model, version)
    return version


async def _served(http: httpx.AsyncClient, model: str, version: int) -> int:
    serves = await fleet_version(http, model)
    if serves > version:
        # Another run moved it further (a fresh run against a fleet left at a later step, say): its samples
        # carry that version, and a trainer sees them as made by other weights.
        log.warning("the fleet of %s serves version %d, past %d: it was not moved", model, serves, version)
    return serves


async def _post(http: httpx.AsyncClient, model: str, body: dict[str, Any], timeout_s: float) -> None:
    r = await http.post(f"/v1/models/{model}/weights", json=body, timeout=timeout_s + 30)
    if r.status_code == 409:
        raise _Behind(r.text)
    checked(r)

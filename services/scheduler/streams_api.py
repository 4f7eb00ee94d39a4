"""REST edge of rollout streams: what the trainer SDK does over NATS, for trainers in other languages.

``POST /v1/streams`` (a job's spec plus ``async_bound``, ``buffer_groups``, ``epochs``, ``shuffle``...),
``GET``/``DELETE /v1/streams/{id}``, ``POST /v1/streams/{id}/batch`` (blocks like ``get_batch``),
``POST /v1/streams/{id}/weights`` and ``POST /v1/streams/{id}/lease``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from fastapi import FastAPI, HTTPException, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, model_validator

from loom.protocol import BatchTaken, StreamSpec, WeightsRef, WeightUpdate, to_builtins
from loom.protocol.messages import WeightDtype, WeightTransport
from loom.runtime.service import Runtime
from loom.trainer.buffer import SampleBuffer, StreamClosed, StreamEnded
from services.scheduler.openapi import answers, body
from services.scheduler.streams import StreamError, StreamManager
from services.scheduler.tasks import SpecError

_STATUS = {
    "not_found": 404,
    "gone": 410,
    "conflict": 409,
    "unavailable": 503,
    "update_failed": 502,
    "quota": 429,
}


class BatchQuery(BaseModel):
    n_groups: int = Field(ge=1, le=10_000)
    timeout_s: float = Field(60.0, gt=0, le=3600)


TensorRow = tuple[
    Annotated[str, Field(min_length=1, max_length=512)], WeightDtype, list[Annotated[int, Field(ge=0)]]
]


class WeightsRefBody(BaseModel):
    """How the version travels (``loom.protocol.WeightsRef`` without the per-worker rank, which the scheduler
    sets): what a trainer's ``loom.weights.publish`` transport staged."""

    transport: WeightTransport
    path: str | None = None
    address: str = Field("", max_length=256)
    group: str = Field("", pattern=r"^[A-Za-z0-9_.-]{0,128}$")
    backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: int = Field(0, ge=0)
    # (name, dtype, shape), in the order the trainer sends them
    tensors: list[TensorRow] = Field([], max_length=1_000_000)
    checksum: str = Field("", max_length=64)

    @model_validator(mode="after")
    def _complete(self) -> WeightsRefBody:
        """What each transport's workers need to take the version."""
        needs = {
            "disk": ("path",),
            "collective": ("address", "group", "tensors"),
            "store": ("group", "tensors"),
        }
        missing = [f for f in needs[self.transport] if not getattr(self, f)]
        if missing:
            raise ValueError(f"a {self.transport} version needs {', '.join(missing)}")
        return self

    def ref(self) -> WeightsRef:
        return msgspec.convert(self.model_dump(), WeightsRef)


class WeightsBody(BaseModel):
    version: int = Field(ge=1)
    # A checkpoint directory every worker reads (the disk transport), or ``weights``: any transport.
    path: str | None = None
    weights: WeightsRefBody | None = None
    timeout_s: float = Field(300.0, gt=0, le=3600)
    # Load while generating and pause only to switch (RollArt §5.2); false: load inside the pause.
    async_fetch: bool = True

    def update(self, stream_id: str) -> WeightUpdate:
        if self.path is not None and self.weights is not None:
            raise HTTPException(status_code=422, detail="give path or weights, not both")
        ref = self.weights.ref() if self.weights is not None else None
        return WeightUpdate(stream_id, self.version, self.path, self.timeout_s, self.async_fetch, ref)


# A fleet is named by its model, as rollout workers register it (a key of the weights bucket).
ModelName = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+){0,7}$", max_length=128)]


def _http(e: StreamError) -> HTTPException:
    return HTTPException(status_code=_STATUS.get(e.code, 400), detail=e.message)


def add_stream_routes(
    app: FastAPI, rt: Runtime, streams: StreamManager, decode_body: Any, tenant_of: Any
) -> None:
    """``tenant_of`` makes a submitted spec its caller's (``services.scheduler.api``): a stream, like a job,
    belongs to the tenant that created it, and another tenant finds no such stream."""
    buffers: dict[str, SampleBuffer] = {}

    def stream_or_404(stream_id: str, request: Request) -> Any:
        try:
            st = streams.get(stream_id)
        except StreamError as e:
            raise _http(e) from e
        if not request.state.principal.owns(st.spec.tenant):
            raise HTTPException(status_code=404, detail=f"unknown stream {stream_id!r}")
        return st

    @app.post(
        "/v1/streams", status_code=201, openapi_extra=body(StreamSpec), responses=answers(403, 422, 429)
    )
    async def create_stream(request: Request) -> JSONResponse:
        spec = decode_body(await request.body(), StreamSpec)
        if isinstance(spec, JSONResponse):
            return spec
        spec = tenant_of(spec, request.state.principal)
        if isinstance(spec, JSONResponse):
            return spec
        try:
            st = await streams.create(spec)
        except SpecError as e:
            return JSONResponse(
                status_code=422,
                content={"detail": [{"loc": ["body", *e.loc], "msg": e.msg, "type": "value_error"}]},
            )
        except StreamError as e:
            return JSONResponse(status_code=_STATUS.get(e.code, 400), content={"detail": e.message})
        return JSONResponse(status_code=201, content=to_builtins(st))

    @app.get("/v1/streams")
    async def list_streams(request: Request) -> dict[str, Any]:
        mine = [s for s in streams.streams.values() if request.state.principal.owns(s.spec.tenant)]
        return {"streams": [to_builtins(s) for s in sorted(mine, key=lambda s: s.created_at)]}

    @app.get("/v1/streams/{stream_id}", responses=answers(404))
    async def get_stream(request: Request, stream_id: str) -> dict[str, Any]:
        return to_builtins(stream_or_404(stream_id, request))

    @app.delete("/v1/streams/{stream_id}", responses=answers(404, 410))
    async def cancel_stream(request: Request, stream_id: str) -> dict[str, Any]:
        stream_or_404(stream_id, request)
        buf = buffers.pop(stream_id, None)
        if buf is not None:
            await buf.close()
        return to_builtins(await streams.cancel(stream_id))

    @app.post("/v1/streams/{stream_id}/lease", responses=answers(404, 409, 410))
    async def renew_lease(request: Request, stream_id: str) -> dict[str, Any]:
        stream_or_404(stream_id, request)
        try:
            return to_builtins(await streams.renew(stream_id))
        except StreamError as e:
            raise _http(e) from e

    @app.post("/v1/streams/{stream_id}/batch", responses=answers(404, 408, 410, 422))
    async def get_batch(request: Request, stream_id: str, q: BatchQuery) -> dict[str, Any]:
        """Blocks until ``n_groups`` groups within the bound are ready (408 after ``timeout_s``)."""
        stream_or_404(stream_id, request)

        async def read() -> Any:
            return streams.get(stream_id)

        async def report(taken: BatchTaken) -> None:
            await streams.taken(taken)

        buf = buffers.get(stream_id)
        if buf is None:
            buf = buffers[stream_id] = SampleBuffer(rt.js, stream_id, read, report)
        try:
            batch = await buf.take(q.n_groups, q.timeout_s)
        except TimeoutError as e:
            raise HTTPException(status_code=408, detail=str(e)) from e
        except StreamClosed as e:
            raise HTTPException(status_code=410, detail=str(e)) from e
        except StreamEnded as e:
            raise HTTPException(status_code=410, detail=str(e)) from e
        return {
            "version": batch.version,
            "stale": batch.stale,
            "groups": [
                {
                    "group": g.group,
                    "task_id": g.task_id,
                    "start_version": g.start_version,
                    "trajectories": [to_builtins(t) for t in g.trajectories],
                }
                for g in batch.groups
            ],
        }

    @app.post("/v1/streams/{stream_id}/weights", responses=answers(404, 409, 410, 422, 502, 503))
    async def update_weights(request: Request, stream_id: str, body: WeightsBody) -> dict[str, Any]:
        stream_or_404(stream_id, request)
        try:
            res = await streams.update_weights(body.update(stream_id))
        except StreamError as e:
            raise _http(e) from e
        return to_builtins(res)

    @app.get("/v1/models/{model}/weights", responses=answers(404, 422))
    async def fleet_weights(model: ModelName) -> dict[str, Any]:
        """The weights the fleet of ``model`` serves (its version and checkpoint), as the last update left it."""
        w = await streams.fleet_version(model)
        if w is None:
            raise HTTPException(
                status_code=404, detail=f"the fleet of {model!r} was never moved off its start"
            )
        return to_builtins(w)

    @app.post("/v1/models/{model}/weights", responses=answers(403, 404, 409, 422, 502))
    async def move_fleet(request: Request, model: ModelName, body: WeightsBody) -> dict[str, Any]:
        """Move every rollout worker of ``model`` to a checkpoint, all or nothing, without a stream: a trainer
        that picks its own prompts (TRL's ``rollout_func``, verl's agent-loop manager) and runs them as jobs.
        The fleet is shared by every tenant's jobs on it: this is the admin's."""
        if not request.state.principal.admin:
            raise HTTPException(status_code=403, detail="moving a shared fleet's weights is the admin's")
        now = await streams.fleet_version(model)
        if now is not None and now.version.isdigit() and body.version <= int(now.version):
            raise HTTPException(
                status_code=409, detail=f"version {body.version} is not after the fleet's {now.version}"
            )
        try:
            res = await streams.move_fleet(model, body.update("fleet"))
        except StreamError as e:
            if e.code == "unavailable":  # no worker serves it: there is no such fleet
                raise HTTPException(status_code=404, detail=e.message) from e
            raise _http(e) from e
        return to_builtins(res)

"""REST edge of the scheduler (FastAPI). Job specs decode strictly with msgspec, the same type as on NATS."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loom import __version__, results
from loom.protocol import Job, JobSpec, RLJobSpec, from_json, to_builtins, to_json
from loom.service import Runtime
from services.scheduler.jobs import JobManager
from services.scheduler.rljobs import RLJobExists, RLJobManager
from services.scheduler.streams import StreamManager
from services.scheduler.streams_api import add_stream_routes
from services.scheduler.tasks import SpecError

T = TypeVar("T")
_PATH = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _loc(message: str) -> list[str | int]:
    """``Expected int, got str - at `$.tasks[0].id``` -> ["body", "tasks", 0, "id"]."""
    loc: list[str | int] = ["body"]
    if " - at `$" in message:
        path = message.rsplit(" - at `$", 1)[1].rstrip("`")
        for name, idx in _PATH.findall(path):
            loc.append(name if name else int(idx))
    return loc


def _unprocessable(loc: list[str | int], msg: str) -> JSONResponse:
    return JSONResponse(
        status_code=422, content={"detail": [{"loc": loc, "msg": msg, "type": "value_error"}]}
    )


def _decode(body: bytes, typ: type[T]) -> T | JSONResponse:
    """A strict decode of a request body, or the 422 that says where it is wrong."""
    try:
        return from_json(body or b"{}", typ)
    except msgspec.ValidationError as e:
        return _unprocessable(_loc(str(e)), str(e).split(" - at `", 1)[0])
    except msgspec.DecodeError as e:
        return _unprocessable(["body"], f"invalid JSON: {e}")


def _job_json(job: Job) -> dict[str, Any]:
    d: dict[str, Any] = to_builtins(job)
    d["spec"].pop("tasks", None)  # can be thousands of entries; GET /v1/jobs/{id}?tasks=true has them
    d["n_tasks"] = len(job.spec.tasks)
    return d


def build_app(rt: Runtime, jobs: JobManager, rljobs: RLJobManager, streams: StreamManager) -> FastAPI:
    app = FastAPI(title="Loom scheduler", version=__version__)
    job_schema = msgspec.json.schema(JobSpec)
    rljob_schema = msgspec.json.schema(RLJobSpec)

    def job_or_404(job_id: str) -> Job:
        job = jobs.get(job_id)
        if job is None:
            raise HTTPException(status_code=404, detail=f"unknown job {job_id!r}")
        return job

    @app.post(
        "/v1/jobs",
        status_code=201,
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": job_schema}}}
        },
    )
    async def submit_job(request: Request) -> JSONResponse:
        spec = _decode(await request.body(), JobSpec)
        if isinstance(spec, JSONResponse):
            return spec
        try:
            job = await jobs.submit(spec)
        except SpecError as e:
            return _unprocessable(["body", *e.loc], e.msg)
        return JSONResponse(status_code=201, content=_job_json(job))

    @app.get("/v1/jobs")
    async def list_jobs() -> dict[str, Any]:
        return {"jobs": [_job_json(j) for j in sorted(jobs.jobs.values(), key=lambda j: j.created_at)]}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, tasks: bool = False) -> dict[str, Any]:
        job = job_or_404(job_id)
        return to_builtins(job) if tasks else _job_json(job)

    @app.get("/v1/jobs/{job_id}/trajectories", response_model=None)
    async def get_trajectories(
        request: Request,
        job_id: str,
        cursor: int = Query(0, ge=0, description="stream sequence to read after (from next_cursor)"),
        limit: int = Query(100, ge=1, le=1000),
        format: str = Query("json", pattern="^(json|ndjson)$"),
    ) -> Response:
        job_or_404(job_id)
        if format == "ndjson" or "application/x-ndjson" in request.headers.get("accept", ""):

            async def lines() -> AsyncIterator[bytes]:
                async for t in results.iter_results(rt.js, job_id):
                    yield to_json(t) + b"\n"

            return StreamingResponse(lines(), media_type="application/x-ndjson")
        items, nxt = await results.page_results(rt.js, job_id, cursor, limit)
        body = {"items": [to_builtins(t) for _, t in items], "next_cursor": nxt, "done": len(items) < limit}
        return JSONResponse(content=body)

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str) -> dict[str, Any]:
        job_or_404(job_id)
        return _job_json(await jobs.cancel(job_id))

    @app.post(
        "/v1/rljobs",
        status_code=201,
        openapi_extra={
            "requestBody": {"required": True, "content": {"application/json": {"schema": rljob_schema}}}
        },
    )
    async def register_rljob(request: Request) -> JSONResponse:
        """Register an RL job for co-scheduling; the answer is its group, nodes and planned iteration."""
        spec = _decode(await request.body(), RLJobSpec)
        if isinstance(spec, JSONResponse):
            return spec
        try:
            placement = await rljobs.register(spec)
        except RLJobExists as e:
            raise HTTPException(status_code=409, detail=str(e)) from e
        return JSONResponse(status_code=201, content=to_builtins(placement))

    @app.get("/v1/rljobs")
    async def list_rljobs() -> dict[str, Any]:
        return {
            "jobs": [to_builtins(p) for p in rljobs.placements.values()],
            "groups": rljobs.groups(),
            "cost_per_hour": round(rljobs.state.cost(), 2),
        }

    def rljob_or_404(name: str) -> None:
        if name not in rljobs.placements:
            raise HTTPException(status_code=404, detail=f"unknown RL job {name!r}")

    @app.get("/v1/rljobs/{name}")
    async def get_rljob(name: str) -> dict[str, Any]:
        rljob_or_404(name)
        return to_builtins(rljobs.placements[name])

    @app.delete("/v1/rljobs/{name}")
    async def remove_rljob(name: str) -> dict[str, Any]:
        rljob_or_404(name)
        return to_builtins(await rljobs.remove(name))

    add_stream_routes(app, rt, streams, _decode)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": rt.nc.is_connected, "service": "scheduler", "version": __version__, **jobs.health()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(rt.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app

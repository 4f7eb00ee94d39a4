"""REST edge of the scheduler (FastAPI). Job specs decode with msgspec into the same type as on NATS, numbers read
as JSON Schema reads them.

Every path asks for a bearer token (``loom.identity.auth``): none, or one the scheduler does not know, is a 401,
logged and counted. A job belongs to the tenant whose token submitted it; another tenant's token finds no
such job (404), and the admin's sees every job. RL co-scheduling (``/v1/rljobs``) places jobs on the shared
cluster and is the admin's."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.datastructures import MutableHeaders
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loom import __version__
from loom.identity.auth import Principal, Tokens, bearer
from loom.protocol import INT_RANGE, Job, JobSpec, RLJobSpec, from_json, out_of_range, to_builtins, to_json
from loom.runtime import bus, results
from loom.runtime.service import Runtime
from services.scheduler import openapi
from services.scheduler.dashboard import BrowserSessions, Dashboard
from services.scheduler.gateway import add_gateway_routes
from services.scheduler.jobs import JobManager, JobTooLarge, NotActing, QuotaExceeded
from services.scheduler.openapi import answers
from services.scheduler.rljobs import RLJobExists, RLJobManager
from services.scheduler.streams import StreamManager
from services.scheduler.streams_api import add_stream_routes
from services.scheduler.tasks import SpecError
from services.scheduler.ui_routes import add_ui_routes

log = logging.getLogger(__name__)
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
    """A request body decoded against ``typ`` (unknown fields refused; ``3.0`` an integer, as JSON Schema has
    it), or the 422 that says where it is wrong."""
    try:
        obj = from_json(body or b"{}", typ, lax=True)
    except msgspec.ValidationError as e:
        return _unprocessable(_loc(str(e)), str(e).split(" - at `", 1)[0])
    except msgspec.DecodeError as e:
        return _unprocessable(["body"], f"invalid JSON: {e}")
    except RecursionError:
        return _unprocessable(["body"], "JSON nested too deeply")
    where = out_of_range(obj)
    if where is not None:
        return _unprocessable(["body", *where], f"integer out of range {INT_RANGE}")
    return obj


def _job_json(job: Job) -> dict[str, Any]:
    d: dict[str, Any] = to_builtins(job)
    d["spec"].pop("tasks", None)  # can be thousands of entries; GET /v1/jobs/{id}?tasks=true has them
    d["n_tasks"] = len(job.spec.tasks)
    return d


def principal(request: Request) -> Principal:
    """The caller, as the authentication middleware established it."""
    who: Principal = request.state.principal
    return who


def tenant_of(spec: JobSpec, who: Principal) -> JobSpec | JSONResponse:
    """The spec as submitted by ``who``: a tenant's job is its own; the admin may submit for anyone."""
    if who.admin:
        return spec
    if spec.tenant not in ("default", who.tenant):
        return JSONResponse(
            status_code=403,
            content={"detail": f"a token of tenant {who.tenant!r} cannot submit for {spec.tenant!r}"},
        )
    spec.tenant = who.tenant
    return spec


def add_auth(app: FastAPI, rt: Runtime, tokens: Tokens, max_body: int, browsers: BrowserSessions) -> None:
    refused = rt.metrics.counter("auth_refused_total", "REST requests refused", ["reason"])
    app.add_middleware(Authenticate, tokens=tokens, max_body=max_body, browsers=browsers, refused=refused)


class Authenticate:
    """Every request names its principal by a bearer token (the dashboard: once in its URL, then a session
    cookie), and announces a body no larger than the limit. A pure ASGI middleware, as each of the scheduler's
    is: Starlette's ``BaseHTTPMiddleware`` ends a streamed body cleanly where the app failed mid-stream, so a
    client would take a truncated result stream for a whole one."""

    def __init__(
        self, app: ASGIApp, tokens: Tokens, max_body: int, browsers: BrowserSessions, refused: Any
    ) -> None:
        self.app, self.tokens, self.max_body, self.browsers, self.refused = (
            app,
            tokens,
            max_body,
            browsers,
            refused,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self._refusal(request)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, request: Request) -> JSONResponse | None:
        token = bearer(request.headers.get("authorization"))
        who = self.tokens.who(token) or self.tokens.session_principal(request.url.path, token)
        if who is None and request.method == "GET" and request.url.path.startswith("/ui"):
            # The dashboard, in a browser: its token once in the URL (/ui?token=...), then its session cookie.
            in_url = request.query_params.get("token", "") if request.url.path == "/ui" else ""
            who = self.tokens.who(in_url) or self.browsers.who(request.cookies.get(BrowserSessions.COOKIE))
        if who is None:
            reason = "wrong_token" if token else "no_token"
            self.refused.labels(reason).inc()
            client = request.client.host if request.client else "?"
            log.warning("refused %s %s from %s: %s", request.method, request.url.path, client, reason)
            return JSONResponse(
                status_code=401,
                content={"detail": "a valid bearer token is required"},
                headers={"WWW-Authenticate": "Bearer"},
            )
        request.state.principal = who  # kept in the scope's state, where the routes' requests read it
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body):
            return JSONResponse(
                status_code=413, content={"detail": f"request bodies are limited to {self.max_body} bytes"}
            )
        if size is None and "chunked" in request.headers.get("transfer-encoding", "").lower():
            # A body of unannounced length could be any size: the limit needs its length up front.
            return JSONResponse(status_code=411, content={"detail": "give the body's Content-Length"})
        return None


class Allow:
    """A 405 names every method the path has (Starlette names only those of the first route it matched)."""

    def __init__(self, app: ASGIApp, routes: FastAPI) -> None:
        self.app, self.routes = app, routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_allowed(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                methods: set[str] = set()
                for route in self.routes.routes:
                    if isinstance(route, APIRoute) and route.matches(scope)[0] != Match.NONE:
                        methods |= route.methods or set()
                headers = MutableHeaders(scope=message)
                headers["Allow"] = ", ".join(sorted(methods))
            await send(message)

        await self.app(scope, receive, send_allowed)


def build_app(
    rt: Runtime,
    jobs: JobManager,
    rljobs: RLJobManager,
    streams: StreamManager,
    tokens: Tokens,
    dashboard: Dashboard | None = None,
) -> FastAPI:
    app = FastAPI(title="Loom scheduler", version=__version__)
    openapi.install(app)
    app.add_middleware(Allow, routes=app)

    async def failing_over(request: Request, e: Exception) -> JSONResponse:
        # Nothing was written (``bus.JS_FAILING_OVER``): the client may send it again once a leader is elected.
        detail = f"the bus is failing over ({e}); nothing was done, try again"
        return JSONResponse(status_code=503, content={"detail": detail}, headers={"Retry-After": "1"})

    for exc in bus.JS_FAILING_OVER:
        app.add_exception_handler(exc, failing_over)

    async def not_acting(request: Request, e: Exception) -> JSONResponse:
        # Its successor answers the same request: the client (or the standby's forwarding) sends it again.
        return JSONResponse(
            status_code=503, content={"detail": f"{e}; try again"}, headers={"Retry-After": "1"}
        )

    app.add_exception_handler(NotActing, not_acting)
    browsers = BrowserSessions()
    add_auth(app, rt, tokens, int(jobs.settings.max_body_mb * 2**20), browsers)
    unreadable = rt.metrics.counter("results_unreadable_total", "Result records skipped as unreadable")

    def bad_result(seq: int, why: str) -> None:
        unreadable.inc()

    def job_or_404(job_id: str, who: Principal) -> Job:
        job = jobs.get(job_id)
        if job is None or not who.owns(job.spec.tenant):
            raise HTTPException(status_code=404, detail=f"unknown job {job_id!r}")
        return job

    def admin_only(who: Principal) -> None:
        if not who.admin:
            raise HTTPException(status_code=403, detail="RL co-scheduling is the admin's")

    @app.post(
        "/v1/jobs", status_code=201, openapi_extra=openapi.body(JobSpec), responses=answers(403, 422, 429)
    )
    async def submit_job(request: Request) -> JSONResponse:
        spec = _decode(await request.body(), JobSpec)
        if isinstance(spec, JSONResponse):
            return spec
        spec = tenant_of(spec, principal(request))
        if isinstance(spec, JSONResponse):
            return spec
        try:
            job = await jobs.submit(spec)
        except SpecError as e:
            return _unprocessable(["body", *e.loc], e.msg)
        except QuotaExceeded as e:
            return JSONResponse(status_code=429, content={"detail": str(e)})
        except JobTooLarge as e:
            return JSONResponse(status_code=413, content={"detail": str(e)})
        return JSONResponse(status_code=201, content=_job_json(job))

    @app.get("/v1/jobs")
    async def list_jobs(request: Request) -> dict[str, Any]:
        who = principal(request)
        mine = [j for j in jobs.jobs.values() if who.owns(j.spec.tenant)]
        return {"jobs": [_job_json(j) for j in sorted(mine, key=lambda j: j.created_at)]}

    @app.get("/v1/jobs/{job_id}", responses=answers(404, 422))
    async def get_job(request: Request, job_id: str, tasks: bool = False) -> dict[str, Any]:
        job = job_or_404(job_id, principal(request))
        return to_builtins(job) if tasks else _job_json(job)

    @app.get("/v1/jobs/{job_id}/trajectories", response_model=None, responses=answers(404, 422))
    async def get_trajectories(
        request: Request,
        job_id: str,
        cursor: int = Query(0, ge=0, description="stream sequence to read after (from next_cursor)"),
        limit: int = Query(100, ge=1, le=1000),
        format: str = Query("json", pattern="^(json|ndjson)$"),
    ) -> Response:
        job_or_404(job_id, principal(request))
        if format == "ndjson" or "application/x-ndjson" in request.headers.get("accept", ""):
            # The first page is read before the answer begins, so a bus that cannot answer gets a 503 the client
            # may retry; a failure later cuts the stream short (the client's read fails), never ends it early.
            first = await results.page_results(rt.js, job_id, cursor, limit, bad_result)

            async def lines() -> AsyncIterator[bytes]:
                items, after, end = first
                while True:
                    for _, t in items:
                        yield to_json(t) + b"\n"
                    if end:
                        return
                    items, after, end = await results.page_results(rt.js, job_id, after, limit, bad_result)

            return StreamingResponse(lines(), media_type="application/x-ndjson")
        skipped: list[int] = []

        def note(seq: int, why: str) -> None:
            skipped.append(seq)
            bad_result(seq, why)

        items, nxt, end = await results.page_results(rt.js, job_id, cursor, limit, note)
        body = {
            "items": [to_builtins(t) for _, t in items],
            "next_cursor": nxt,
            "done": end,
            "skipped": skipped,  # stream sequences of records that could not be read
        }
        return JSONResponse(content=body)

    @app.delete("/v1/jobs/{job_id}", responses=answers(404))
    async def cancel_job(request: Request, job_id: str) -> dict[str, Any]:
        job_or_404(job_id, principal(request))
        return _job_json(await jobs.cancel(job_id))

    @app.post(
        "/v1/rljobs", status_code=201, openapi_extra=openapi.body(RLJobSpec), responses=answers(403, 409, 422)
    )
    async def register_rljob(request: Request) -> JSONResponse:
        """Register an RL job for co-scheduling; the answer is its group, nodes and planned iteration."""
        admin_only(principal(request))
        spec = _decode(await request.body(), RLJobSpec)
        if isinstance(spec, JSONResponse):
            return spec
        try:
            placement = await rljobs.register(spec)
        except RLJobExists as e:
            raise HTTPException(status_code=409, detail=str(e)) from e
        return JSONResponse(status_code=201, content=to_builtins(placement))

    @app.get("/v1/rljobs", responses=answers(403))
    async def list_rljobs(request: Request) -> dict[str, Any]:
        admin_only(principal(request))
        return {
            "jobs": [to_builtins(p) for p in rljobs.placements.values()],
            "groups": rljobs.groups(),
            "cost_per_hour": round(rljobs.state.cost(), 2),
        }

    def rljob_or_404(name: str) -> None:
        if name not in rljobs.placements:
            raise HTTPException(status_code=404, detail=f"unknown RL job {name!r}")

    @app.get("/v1/rljobs/{name}", responses=answers(403, 404))
    async def get_rljob(request: Request, name: str) -> dict[str, Any]:
        admin_only(principal(request))
        rljob_or_404(name)
        return to_builtins(rljobs.placements[name])

    @app.delete("/v1/rljobs/{name}", responses=answers(403, 404))
    async def remove_rljob(request: Request, name: str) -> dict[str, Any]:
        admin_only(principal(request))
        rljob_or_404(name)
        return to_builtins(await rljobs.remove(name))

    add_stream_routes(app, rt, streams, _decode, tenant_of)
    add_gateway_routes(app, rt, jobs, jobs.settings, principal, tokens)
    add_ui_routes(app, dashboard or Dashboard(rt, jobs, streams, rljobs), browsers)

    @app.get("/healthz", responses=answers(503))
    async def healthz() -> JSONResponse:
        ok = rt.nc.is_connected
        body = {"ok": ok, "service": "scheduler", "version": __version__, **jobs.health()}
        return JSONResponse(status_code=200 if ok else 503, content=body)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(rt.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app

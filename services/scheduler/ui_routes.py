"""``/ui``: the live dashboard page, its assets (shipped in ``static/``, no CDN), its data and its events.

``GET /ui?token=...`` checks the token like any request, opens a browser session (an HttpOnly, SameSite
cookie scoped to ``/ui``) and redirects to ``/ui``, so the token leaves the address bar and history. The
cookie is good for reading the dashboard only: every other path still asks for the bearer token.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from loom.identity.auth import Principal
from services.scheduler.dashboard import BrowserSessions, Dashboard

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript", "app.css": "text/css"}


def add_ui_routes(app: FastAPI, dash: Dashboard, browsers: BrowserSessions) -> None:
    def who(request: Request) -> Principal:
        p: Principal = request.state.principal
        return p

    @app.get("/ui", response_class=Response, include_in_schema=False)
    async def page(request: Request) -> Response:
        if "token" in request.query_params:
            key = browsers.open(who(request))
            out = RedirectResponse("/ui", status_code=303)
            out.set_cookie(BrowserSessions.COOKIE, key, httponly=True, samesite="strict", path="/ui")
            return out
        # The first snapshot rides in the page, so it is drawn at once (and before the load event).
        state = json.dumps(dash.snapshot(who(request))).replace("</", "<\\/")
        html = (
            (STATIC / "index.html")
            .read_text()
            .replace("<!--STATE-->", f"<script>window.LOOM_STATE = {state};</script>")
        )
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/ui/static/{name}", response_class=Response, include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise HTTPException(status_code=404, detail=f"no asset {name!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    @app.get("/ui/state", include_in_schema=False)
    async def state(request: Request) -> JSONResponse:
        return JSONResponse(content=dash.snapshot(who(request)))

    @app.get("/ui/events", include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        return StreamingResponse(
            dash.events(who(request)), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
        )

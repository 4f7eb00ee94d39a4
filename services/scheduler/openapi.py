"""The scheduler's OpenAPI document: the msgspec body schemas as resolvable components, the bearer scheme,
and every answer a path can give, so that a generated client (or schemathesis) knows them all."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from loom.protocol import JobSpec, RLJobSpec, StreamSpec
from loom.protocol.sessions import ChatRequest, CompletionRequest, FinishRequest, GenerateRequest

_SPECS = (JobSpec, RLJobSpec, StreamSpec, ChatRequest, CompletionRequest, GenerateRequest, FinishRequest)
_REFS, COMPONENTS = msgspec.json.schema_components(_SPECS, ref_template="#/components/schemas/{name}")
_BODY: dict[type, dict[str, Any]] = dict(zip(_SPECS, _REFS, strict=True))

ERROR = {
    "type": "object",
    "properties": {"detail": {"description": "what is wrong: a message, or a list of {loc, msg, type}"}},
    "required": ["detail"],
}
# The OpenAI gateway's errors are OpenAI's error object, which its clients read.
OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}},
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}
_WHY = {
    400: "the body is not JSON, or not a request the session can serve",
    401: "no bearer token, or one the scheduler does not know",
    403: "the token's tenant may not do this",
    404: "no such resource for this token's tenant",
    408: "nothing ready within the timeout",
    409: "it conflicts with the resource's state",
    410: "the stream has ended or was cancelled",
    411: "a body without a Content-Length",
    413: "the body, or the job it makes, is too large",
    422: "the body or a parameter is invalid; detail says where",
    429: "the tenant's trajectories in flight would pass its quota",
    500: "the session's trajectory failed (the reason is in the message)",
    502: "the weight update failed on a worker",
    503: "unavailable: no NATS connection, no worker to update, or the session's trajectory ended",
    504: "the session did not answer in time",
}


def body(spec: type) -> dict[str, Any]:
    """``openapi_extra`` for a path whose JSON body is ``spec``."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _BODY[spec]}}}}


def answers(*codes: int, schema: dict[str, Any] = ERROR) -> dict[int | str, dict[str, Any]]:
    """``responses`` for a path that can answer these errors (besides its success)."""
    return {c: {"description": _WHY[c], "content": {"application/json": {"schema": schema}}} for c in codes}


def install(app: FastAPI) -> None:
    """Every path asks for the bearer token and may answer 401; a body may be refused for its size."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        comps = doc.setdefault("components", {})
        comps.setdefault("schemas", {}).update(COMPONENTS)
        comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        for ops in doc["paths"].values():
            for op in ops.values():
                extra = (400, 401, 411, 413) if "requestBody" in op else (401,)
                for code, answer in answers(*extra).items():
                    op["responses"].setdefault(str(code), answer)
        app.openapi_schema = doc
        return doc

    app.openapi = build  # type: ignore[method-assign]

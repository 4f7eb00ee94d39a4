"""The OpenAI-compatible gateway: an external agent drives each trajectory of an ``"env": "external"`` job.

``GET /v1/jobs/{id}/sessions`` lists the job's sessions: each trajectory's id, task and ``base_url``, the
OpenAI client's base URL (``.../v1/sessions/{session_id}/v1``). Under it: ``POST /chat/completions`` and
``POST /completions`` (streamed or not; ``tools``, ``logprobs``, ``top_logprobs``, ``stop``, vLLM's
``stop_token_ids`` and ``return_token_ids``, ``n`` choices), ``GET /models``; beside it, as vLLM mounts it at its
root, the token-in, token-out ``POST .../v1/sessions/{session_id}/inference/v1/generate``.
``POST /v1/sessions/{session_id}/finish`` with ``{"reward": r}`` (or null: the job's reward function scores
it) ends the trajectory (also at ``{base_url}/finish``, for the OpenAI client's ``post``). Each session comes
with its own ``api_key`` for the OpenAI client: it opens that session's paths and nothing else, so an agent
(and the tools it runs) need not hold the tenant's token, which works there too.

The calls travel over NATS to the environment manager running the session (``services.envmgr.external``),
which calls the engines through the router like every trajectory; a call that comes before its trajectory
has started waits for it, up to ``session_start_wait_s``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from loom.identity.auth import Principal, Tokens
from loom.protocol import Job, decode, encode, subjects, to_builtins
from loom.protocol.sessions import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    FinishRequest,
    GenerateRequest,
    SessionCall,
    SessionReply,
    read_request,
)
from loom.runtime.service import Runtime
from loom.runtime.workers import context_limit, read_workers
from loom.text import openai_api
from services.scheduler.jobs import JobManager
from services.scheduler.openapi import OPENAI_ERROR, answers, body
from services.scheduler.settings import SchedulerSettings
from services.scheduler.tasks import expand

# A session id is the job's id and the trajectory's, dot-joined: both are NATS subject tokens.
_SESSION = re.compile(r"^(job-[0-9a-f]{1,32})\.(t\d{5}-s\d{3})$")
_NO_SESSION = "unknown session"


def session_id(job_id: str, traj_id: str) -> str:
    return f"{job_id}.{traj_id}"


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=openai_api.error(status, message, param))


def _sse(chunks: Any) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for c in chunks:
            yield b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return gen()


def add_gateway_routes(
    app: FastAPI,
    rt: Runtime,
    jobs: JobManager,
    settings: SchedulerSettings,
    principal: Callable[[Request], Principal],
    tokens: Tokens,
) -> None:
    def session_job(request: Request, sid: str) -> tuple[Job, str] | JSONResponse:
        m = _SESSION.match(sid)
        job = jobs.get(m.group(1)) if m else None
        who = principal(request)
        if m is None or job is None or job.spec.env != "external":
            return _error(404, f"{_NO_SESSION} {sid!r}")
        if who.session != sid and not who.owns(job.spec.tenant):
            return _error(404, f"{_NO_SESSION} {sid!r}")
        traj = m.group(2)
        group, sample = int(traj[1:6]), int(traj[8:])
        if group >= len(job.spec.tasks) or sample >= job.spec.group_size + job.spec.redundancy:
            return _error(404, f"{_NO_SESSION} {sid!r}")
        return job, traj

    async def call(job: Job, traj: str, c: SessionCall) -> SessionReply:
        subject = subjects.session(job.id, traj)
        deadline = time.monotonic() + settings.session_start_wait_s
        while True:
            try:
                msg = await rt.nc.request(subject, encode(c), timeout=settings.session_call_timeout_s)
                return decode(msg.data, SessionReply)
            except NoRespondersError:
                current = jobs.get(job.id)
                if current is not None and current.state in ("completed", "cancelled", "failed"):
                    return SessionReply(409, openai_api.error(409, f"job {job.id} is {current.state}"))
                if time.monotonic() >= deadline:
                    return SessionReply(
                        409,
                        openai_api.error(
                            409, "the session is not running: it has ended, or has not started yet (retry)"
                        ),
                    )
                await asyncio.sleep(0.2)
            except NatsTimeout:
                return SessionReply(504, openai_api.error(504, "the session did not answer in time"))

    async def generate(
        request: Request, sid: str, typ: type[ChatRequest | CompletionRequest | GenerateRequest]
    ) -> Response:
        found = session_job(request, sid)
        if isinstance(found, JSONResponse):
            return found
        req = read(await request.body(), typ)
        if isinstance(req, JSONResponse):
            return req
        if isinstance(req, ChatRequest):
            reply = await call(*found, SessionCall("chat", chat=req))
        elif isinstance(req, CompletionRequest):
            reply = await call(*found, SessionCall("completion", completion=req))
        else:
            reply = await call(*found, SessionCall("generate", generate=req))
        if reply.status != 200 or isinstance(req, GenerateRequest) or not req.stream:
            return JSONResponse(status_code=reply.status, content=reply.body)
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_sse(openai_api.chunks(reply.body, usage)), media_type="text/event-stream")

    def read(raw: bytes, typ: type[Any]) -> Any:
        try:
            return read_request(raw, typ)
        except BadRequest as e:
            return _error(400, str(e), e.param)

    @app.get("/v1/jobs/{job_id}/sessions", responses=answers(404, 409))
    async def list_sessions(request: Request, job_id: str) -> JSONResponse:
        """The sessions of an external job: each trajectory's id, task and the OpenAI client's base URL."""
        job = jobs.get(job_id)
        if job is None or not principal(request).owns(job.spec.tenant):
            return JSONResponse(status_code=404, content={"detail": f"unknown job {job_id!r}"})
        if job.spec.env != "external":
            return JSONResponse(
                status_code=409,
                content={"detail": f"job {job_id} runs environment {job.spec.env!r}, not external"},
            )
        base = str(request.base_url).rstrip("/")
        sessions = []
        for w in expand(job.id, job.spec):
            sid = session_id(job.id, w.traj_id)
            sessions.append(
                {
                    "traj_id": w.traj_id,
                    "session_id": sid,
                    "task": to_builtins(w.task),
                    "base_url": f"{base}/v1/sessions/{sid}/v1",
                    # What the agent presents as its api_key: it opens this session and nothing else.
                    "api_key": tokens.session_key(sid),
                }
            )
        return JSONResponse(content={"sessions": sessions})

    @app.post(
        "/v1/sessions/{sid}/v1/chat/completions",
        openapi_extra=body(ChatRequest),
        responses=answers(400, 404, 409, 500, 503, 504, schema=OPENAI_ERROR),
    )
    async def chat_completions(request: Request, sid: str) -> Response:
        """OpenAI's chat completions on the session's trajectory (Qwen3's chat template and tool calls)."""
        return await generate(request, sid, ChatRequest)

    @app.post(
        "/v1/sessions/{sid}/v1/completions",
        openapi_extra=body(CompletionRequest),
        responses=answers(400, 404, 409, 500, 503, 504, schema=OPENAI_ERROR),
    )
    async def completions(request: Request, sid: str) -> Response:
        """OpenAI's text completions on the session's trajectory (a prompt of text or token ids)."""
        return await generate(request, sid, CompletionRequest)

    @app.post(
        "/v1/sessions/{sid}/inference/v1/generate",
        openapi_extra=body(GenerateRequest),
        responses=answers(400, 404, 409, 500, 503, 504, schema=OPENAI_ERROR),
    )
    async def generate_tokens(request: Request, sid: str) -> Response:
        """vLLM's token-in, token-out generate on the session's trajectory (at the server's root, beside the OpenAI
        base URL, as vLLM mounts it): prompt ids in, output ids and log-probs out."""
        return await generate(request, sid, GenerateRequest)

    @app.get("/v1/sessions/{sid}/v1/models", responses=answers(404, schema=OPENAI_ERROR))
    async def models(request: Request, sid: str) -> Response:
        found = session_job(request, sid)
        if isinstance(found, JSONResponse):
            return found
        job = found[0]
        entry: dict[str, Any] = {
            "id": job.spec.model,
            "object": "model",
            "created": int(job.created_at),
            "owned_by": "loom",
        }
        # vLLM's card names the longest context: clients (verifiers' renderers) check prompts against it.
        limit = context_limit((await read_workers(rt.js)).values(), job.spec.model)
        if limit is not None:
            entry["max_model_len"] = limit
        return JSONResponse(content={"object": "list", "data": [entry]})

    finish_errors = answers(400, 404, 409, 500, 503, 504, schema=OPENAI_ERROR)
    finish_body = body(FinishRequest)

    # Also under the client's base URL, so that an OpenAI client can finish its session itself.
    @app.post("/v1/sessions/{sid}/v1/finish", responses=finish_errors, openapi_extra=finish_body)
    @app.post("/v1/sessions/{sid}/finish", responses=finish_errors, openapi_extra=finish_body)
    async def finish(request: Request, sid: str) -> Response:
        """End the session's trajectory, with the agent's reward or none (the job's reward function scores)."""
        found = session_job(request, sid)
        if isinstance(found, JSONResponse):
            return found
        done = read(await request.body(), FinishRequest)
        if isinstance(done, JSONResponse):
            return done
        reply = await call(*found, SessionCall("finish", reward=done.reward))
        return JSONResponse(status_code=reply.status, content=reply.body)

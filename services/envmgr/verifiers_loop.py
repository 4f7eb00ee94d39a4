"""The per-trajectory loop of a verifiers environment (``"env": "verifiers:<id>"``): the environment's own rollout
code drives the trajectory, as it would against a vLLM server.

Its OpenAI client is answered in this process by an external agent's session (``services.envmgr.external``):
the same code as the gateway's, so each call is a model call of the trajectory through the router, the context
grows by the ids the engine produced and only the new messages' ids, and each reply carries vLLM's
``prompt_token_ids``, ``token_ids`` and log-probs, which verifiers records in its trajectory. When the rollout
ends, the environment's rubric scores it: that reward is the trajectory's (its verdict's score), beside the
rubric's metrics and the rollout's stop condition.

verifiers and the OpenAI client (whose HTTP is httpx2) are optional: the manager imports this module only when a
job names a verifiers environment.
"""

from __future__ import annotations

from typing import Any

import httpx2
from openai import AsyncOpenAI

from loom.envs import registry
from loom.envs.adapters import LibraryError
from loom.envs.adapters import verifiers as adapter
from loom.protocol import Trajectory, TrajWork, encode
from loom.protocol.sessions import BadRequest, ChatRequest, CompletionRequest, SessionCall, read_request
from loom.text import openai_api
from services.envmgr.context import CONTEXT_FULL, LoopContext
from services.envmgr.external import Session

# The base URL of the in-process client: nothing listens there, the transport answers.
BASE_URL = "http://loom-session/v1"


class SessionTransport(httpx2.AsyncBaseTransport):
    """HTTP for an OpenAI client, answered by ``session`` without a socket: chat and text completions, and the
    model list."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        path = request.url.path.removeprefix("/v1")
        if request.method == "GET" and path == "/models":
            card = {"id": self.session.work.model, "object": "model", "owned_by": "loom"}
            return httpx2.Response(200, json={"object": "list", "data": [card]})
        kinds: dict[str, type[ChatRequest] | type[CompletionRequest]] = {
            "/chat/completions": ChatRequest,
            "/completions": CompletionRequest,
        }
        typ = kinds.get(path)
        if request.method != "POST" or typ is None:
            return httpx2.Response(404, json=openai_api.error(404, f"no route {request.method} {path}"))
        try:
            req = read_request(await request.aread(), typ)
        except BadRequest as e:
            return httpx2.Response(400, json=openai_api.error(400, str(e), e.param))
        if req.stream:
            return httpx2.Response(400, json=openai_api.error(400, "stream: not served in process", "stream"))
        call = (
            SessionCall("chat", chat=req)
            if isinstance(req, ChatRequest)
            else SessionCall("completion", completion=req)
        )
        reply = await self.session.answer(encode(call))
        return httpx2.Response(reply.status, json=reply.body)


async def run_verifiers(work: TrajWork, ctx: LoopContext) -> Trajectory:
    _, env_id = registry.resolve(work.env).library() or (None, "")
    params = dict(work.task.data.get("params") or {})
    # On this thread: a verifiers Environment installs signal handlers as it is built. It is built once.
    env = adapter.load(env_id, params)
    record = adapter.task(env_id, params, work.task.id)
    vf = adapter.library()
    session = Session(work, ctx)
    started = ctx.clock.now()
    http = httpx2.AsyncClient(transport=SessionTransport(session), base_url=BASE_URL)
    try:
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=BASE_URL, api_key="session", http_client=http, max_retries=0)
        )
        # What verifiers' own clients ask vLLM for to keep a trajectory's token ids and log-probs.
        sampling: dict[str, Any] = {"logprobs": True, "extra_body": {"return_token_ids": True}}
        state = await env.rollout(record, client, work.model, sampling)
        if session.failure is not None:
            raise session.failure
        # The rollout ends on an error where a budget ran out: verifiers reads the context limit's 400 as an
        # overlong prompt, and a spent budget's as the model's error. Either ends the trajectory as the other
        # loops end it; any other error fails it.
        if state.get("prompt_too_long"):
            finish = CONTEXT_FULL
        elif session.spent is not None:
            finish = session.spent
        elif state.get("error") is not None:
            raise LibraryError(f"{work.env}: the rollout failed: {state['error']!r}")
        else:
            finish = "finished"
        await env.rubric.score_rollout(state)
    finally:
        session.cancel_prediction()
        await http.aclose()
    session.finish(float(state["reward"]))
    metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
    return session.trajectory(started, finish, metrics=metrics, stop_condition=state.get("stop_condition"))

"""External agents' sessions: OpenAI-compatible requests as the gateway accepts them, and how they travel
from the scheduler's gateway to the environment manager running the session's trajectory.

The request types follow the OpenAI API (and vLLM's ``return_token_ids``); fields an agent's client sends that
change nothing here (``user``, ``metadata``, ``seed``, ...) are accepted and ignored, as vLLM does, and those
Loom cannot honour are refused by name (``n`` > 1, ``stop``, ``top_logprobs`` > 0, ``echo``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Tokens = Annotated[int, Meta(ge=1, le=1_000_000)]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]


class StreamOptions(Struct):
    include_usage: bool = False


class Sampling(Struct):
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    n: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None

    def unsupported(self) -> str | None:
        if self.n not in (None, 1):
            return "n: a session generates one reply per call (start more sessions for more samples)"
        if self.stop:
            return "stop: stop sequences are not supported; the turn ends at the model's end-of-turn token"
        if self.top_logprobs:
            return "top_logprobs: only the sampled tokens' log-probs are returned"
        return None


class ChatRequest(Sampling):
    messages: list[dict[str, Any]] = []
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = False
    max_completion_tokens: Tokens | None = None
    # Qwen3's switch: {"enable_thinking": false} renders an empty thought, as its template does.
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] = ""
    model: str | None = None
    # The completions API's logprobs is a count of alternatives: any number returns the sampled tokens'.
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool | None = False


class FinishRequest(Struct):
    """The body of ``finish``: the trajectory's reward, or null for the job's reward function to score it."""

    reward: float | None = None


class SessionCall(Struct):
    """A call on a session, from the gateway to the environment manager running it."""

    kind: Literal["chat", "completion", "finish"]
    chat: ChatRequest | None = None
    completion: CompletionRequest | None = None
    # finish: the trajectory's reward, or None for the job's reward function to score it.
    reward: float | None = None


class SessionReply(Struct):
    """The HTTP status and JSON body the gateway answers with (an OpenAI error object when not 200)."""

    status: int
    body: dict[str, Any]

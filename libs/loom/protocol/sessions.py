"""External agents' sessions: OpenAI-compatible requests as the gateway accepts them, and how they travel
from the scheduler's gateway to the environment manager running the session's trajectory.

The request types follow the OpenAI API (and vLLM's ``return_token_ids``); fields an agent's client sends that
change nothing here (``user``, ``metadata``, ``seed``, ...) are accepted and ignored, as vLLM does, and those
Loom cannot honour are refused by name (``echo``; ``top_logprobs`` where the engine returns none).

Honoured: ``stop`` (up to 4 strings) and vLLM's ``stop_token_ids``, ``n`` samples of one call (up to
``MAX_N``), ``top_logprobs`` (up to 20 alternatives per token; the completions API's ``logprobs`` count)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from loom.protocol.codec import INT_RANGE, from_json, out_of_range

T = TypeVar("T")

Tokens = Annotated[int, Meta(ge=1, le=1_000_000)]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]


class StreamOptions(Struct):
    include_usage: bool = False


MAX_N = 16  # samples of one call: each is a generation of its own on the engine


class Sampling(Struct):
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None  # vLLM's extension
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None

    def stops(self) -> list[str]:
        """The stop strings (empty ones stop nothing)."""
        given = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in given if s]

    def top(self) -> int:
        """How many alternatives of each token to return."""
        return self.top_logprobs or 0

    def unsupported(self) -> str | None:
        """Why the request cannot be answered as asked, naming the field; None when it can."""
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

    def unsupported(self) -> str | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs: needs logprobs true"
        return None


class CompletionRequest(Sampling):
    prompt: str | list[int] = ""
    model: str | None = None
    # The completions API's logprobs is a count of alternatives: the sampled tokens' log-probs, and that
    # many alternatives of each (``top_logprobs``, given, takes precedence).
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool | None = False

    def top(self) -> int:
        return self.top_logprobs if self.top_logprobs is not None else self.logprobs or 0

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo: the prompt is not echoed (return_token_ids gives its ids)"
        if self.top_logprobs and self.logprobs is None:
            return "top_logprobs: needs logprobs"
        return None


# Sampling fields of vLLM's SamplingParams that Loom keeps neutral, so that what is sampled is the full
# distribution at the temperature whose log-probs a trainer computes, with the values that leave it so.
NEUTRAL_SAMPLING: dict[str, tuple[float, ...]] = {
    "top_k": (0, -1),
    "min_p": (0.0,),
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
}


class GenerateParams(Struct):
    """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them in JSON: the fields Loom acts on (others,
    such as ``seed`` or ``skip_special_tokens``, change nothing here and are ignored, as for the OpenAI routes)."""

    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stop: str | Annotated[list[str], Meta(max_length=4)] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    # How many alternatives of each sampled token to return beside its log-prob (None: no log-probs).
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None


class GenerateRequest(Struct):
    """vLLM's token-in, token-out ``POST /inference/v1/generate`` (what verifiers' training client and SkyRL send):
    prompt ids in, output ids and log-probs out, no template applied."""

    token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1)]
    sampling_params: GenerateParams = msgspec.field(default_factory=GenerateParams)
    model: str | None = None
    request_id: str | None = None

    def completion(self) -> CompletionRequest:
        """The same call as a text completion of the ids, with vLLM's ``return_token_ids``; BadRequest naming a
        sampling field that would sample from another distribution than the one recorded."""
        sp = self.sampling_params
        for name, neutral in NEUTRAL_SAMPLING.items():
            value = getattr(sp, name)
            if value is not None and value not in neutral:
                raise BadRequest(
                    f"{name}: Loom samples the full distribution at the temperature, whose log-probs it records; "
                    f"{name} {value} would change it",
                    name,
                )
        return CompletionRequest(
            prompt=list(self.token_ids),
            model=self.model,
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            n=sp.n,
            stop=sp.stop,
            stop_token_ids=sp.stop_token_ids,
            return_token_ids=True,
            logprobs=0 if sp.logprobs is not None else None,
            top_logprobs=sp.logprobs or None,
        )


class FinishRequest(Struct):
    """The body of ``finish``: the trajectory's reward, or null for the job's reward function to score it."""

    reward: float | None = None


class SessionCall(Struct):
    """A call on a session, from the gateway to the environment manager running it."""

    kind: Literal["chat", "completion", "generate", "finish"]
    chat: ChatRequest | None = None
    completion: CompletionRequest | None = None
    generate: GenerateRequest | None = None
    # finish: the trajectory's reward, or None for the job's reward function to score it.
    reward: float | None = None


class SessionReply(Struct):
    """The HTTP status and JSON body the gateway answers with (an OpenAI error object when not 200)."""

    status: int
    body: dict[str, Any]


class BadRequest(ValueError):
    """A request body that is not the type asked for: the message, and the field it names (None: none)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def read_request(raw: bytes, typ: type[T]) -> T:
    """An OpenAI request's JSON body as ``typ``, numbers read as JSON Schema reads them; BadRequest naming the
    field that is wrong, as an OpenAI server answers 400."""
    try:
        req = from_json(raw or b"{}", typ, lax=True)
    except msgspec.ValidationError as e:
        where = str(e).rsplit(" - at `$.", 1)
        raise BadRequest(
            str(e).split(" - at `", 1)[0], where[1].rstrip("`") if len(where) == 2 else None
        ) from e
    except (msgspec.DecodeError, RecursionError) as e:
        raise BadRequest(f"invalid JSON: {e}") from e
    loc = out_of_range(req)
    if loc is not None:
        # Named as msgspec names a field: messages[0].content
        param = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in loc).lstrip(".")
        raise BadRequest(f"Integer out of range {INT_RANGE}", param)
    return req

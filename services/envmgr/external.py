"""Trajectories an external agent drives through the OpenAI-compatible gateway (``"env": "external"``).

The environment manager that pulls such a trajectory answers its session's subject
(``subjects.session``) until the agent finishes it, goes quiet for ``session_idle_s``, or the job ends.
Each chat or completion call is one model call through the router (priority, placement and migration
as for any trajectory), with the prediction made while the agent ran its tools.

The trajectory records ids exactly as the engine saw and produced them. When the agent sends back the chat
it was answered (the previous messages, the reply as returned, then new tool or user messages), the context
is the previous context, the reply's output ids as generated, and only the new messages' ids: nothing is
decoded and encoded again. A history the agent rewrote is rendered afresh and that step marked
``rebased``; a completion whose prompt extends the previous context likewise adds only its new ids.

``stop`` (strings) and ``stop_token_ids`` go to the engine, which stops on them where it can (SGLang), and the
output is cut here in any case (``openai_api.cut_at_stop``): the step records the engine's ids and log-probs
up to and including the token that completed the first stop string (or the first stop id), the reply's text
ends before the stop string, and the context goes on from the ids recorded, as after a length limit.

``n`` > 1 makes n generations of the same context (requests of their own, ``rid`` suffixed ``.s<i>``),
returned as choices 0 to n-1. The step records the choice the agent continues from (the one whose message,
or ids, its next call carries; choice 0 when it finishes or rewrites its history) and keeps the others in
``Step.siblings``: the trajectory's sequence is the path the agent took, so its trainers see that path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.msg import Msg

from loom.engine.token_ids import QWEN3_VOCAB
from loom.envs.base import EnvError
from loom.predict import context as predict_context
from loom.protocol import Prediction, Sibling, Step, Trajectory, TrajWork, decode, encode, subjects
from loom.protocol.sessions import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    Sampling,
    SessionCall,
    SessionReply,
)
from loom.runtime.genclient import GenFailed
from loom.text import chat, openai_api
from services.envmgr.context import (
    LoopContext,
    ModelCall,
    TrajectoryAborted,
    call_model,
    context_room,
    trajectory,
)
from services.envmgr.prediction import await_prediction, predict

log = logging.getLogger(__name__)


class CallError(Exception):
    """A call the session refuses (answered with ``status`` and an OpenAI error; the session goes on)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Sample:
    """One sample (choice) of a call: what was returned, and what the trajectory records of it."""

    call: ModelCall
    output_ids: list[int]  # the engine's ids, cut after the token that completed the stop that ended it
    logprobs: list[float] | None
    top: list[list[tuple[int, float]]] | None  # each output token's top alternatives
    text: str  # as returned: before the stop string, without the end-of-turn token
    stopped: bool  # an agent's stop ended it

    @property
    def finish(self) -> str:
        return "stop" if self.stopped or chat.ended(self.output_ids) else "length"

    def sibling(self, choice: int) -> Sibling:
        return Sibling(choice, len(self.output_ids), self.text, self.output_ids, self.logprobs, self.finish)


@dataclass
class _Turn:
    """A reply given (one sample per choice), waiting for what the agent sends after it."""

    samples: list[_Sample]
    context: list[int]  # the call's whole context
    prompt_ids: list[int]  # what this call added to the context (all of it when rebased)
    replied_at: float
    rebased: bool
    messages: list[chat.Message] = field(default_factory=list)  # chat: each choice's message as returned
    chosen: int = 0  # the choice the agent continued from
    prediction: asyncio.Task[Prediction] | None = None

    def ids(self, choice: int) -> list[int]:
        """The context after choice ``choice``: what a call that continues from it extends."""
        return self.context + self.samples[choice].output_ids


def _same(a: chat.Message, b: chat.Message) -> bool:
    """Whether a message the agent sent back is the one the session holds (ids of tool calls aside)."""
    if a.get("role") != b.get("role") or chat.text_of(a.get("content")) != chat.text_of(b.get("content")):
        return False

    def calls(m: chat.Message) -> list[tuple[Any, Any]]:
        out = []
        for c in m.get("tool_calls") or ():
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            out.append((fn.get("name"), fn.get("arguments")))
        return out

    return calls(a) == calls(b)


@dataclass
class Session:
    work: TrajWork
    ctx: LoopContext
    # The messages of the last chat call (the reply's not among them: each choice's is in the pending turn).
    chat_seen: list[chat.Message] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    steps: list[Step] = field(default_factory=list)
    pending: _Turn | None = None
    generated: int = 0
    priority: float = 0.0
    prompt: str = ""
    prompt_tokens: int = 0  # the first call's context
    acts: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    last_call: float = field(default_factory=time.monotonic)
    busy: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    failure: BaseException | None = None
    reward: float | None = None
    spent: str | None = None  # the budget a call was refused for having run out: max_turns or max_tokens

    async def on_msg(self, msg: Msg) -> None:
        self.busy = True
        try:
            reply = await self.answer(msg.data)
        except asyncio.CancelledError:
            # The trajectory ended under this call (its job was cancelled): say so rather than leave it hanging.
            with contextlib.suppress(Exception):
                await msg.respond(encode(SessionReply(409, openai_api.error(409, "this session has ended"))))
            raise
        finally:
            self.busy = False
            self.last_call = time.monotonic()
        with contextlib.suppress(Exception):  # the gateway may have given up; the session goes on
            await msg.respond(encode(reply))

    async def answer(self, data: bytes) -> SessionReply:
        """A call, encoded as it travels on the bus, answered as the gateway passes it on."""
        if self.ended.is_set():
            return SessionReply(409, openai_api.error(409, "this session has ended"))
        try:
            call = decode(data, SessionCall)
            if call.kind == "finish":
                return self.finish(call.reward)
            if call.kind == "chat" and call.chat is not None:
                return SessionReply(200, await self._chat(call.chat))
            if call.kind == "completion" and call.completion is not None:
                return SessionReply(200, await self._text_completion(call.completion))
            if call.kind == "generate" and call.generate is not None:
                return SessionReply(200, await self._tokens(call.generate))
            raise CallError(400, f"a {call.kind} call without its request")
        except CallError as e:
            named = re.match(r"([a-z_]+): ", str(e))  # a refusal that names the field it refuses
            return SessionReply(e.status, openai_api.error(e.status, str(e), named and named.group(1)))
        except msgspec.DecodeError as e:
            return SessionReply(400, openai_api.error(400, f"unreadable call: {e}"))
        except (TrajectoryAborted, EnvError) as e:
            self._fail(e)
            return SessionReply(503, openai_api.error(503, f"the trajectory ended: {e}"))
        except Exception as e:
            log.exception("session %s.%s failed", self.work.job_id, self.work.traj_id)
            self._fail(e)
            return SessionReply(500, openai_api.error(500, f"the trajectory failed: {type(e).__name__}: {e}"))

    def _fail(self, e: BaseException) -> None:
        self.failure = e
        self.ended.set()

    def finish(self, reward: float | None) -> SessionReply:
        if reward is None and self.work.reward == "env":
            raise CallError(400, "reward: this job names no reward function to score the session; give one")
        self.cancel_prediction()
        self._close_turn("", 0.0 if self.pending is None else self.ctx.clock.now() - self.pending.replied_at)
        self.reward = reward
        self.ended.set()
        return SessionReply(
            200,
            {"traj_id": self.work.traj_id, "status": "finished", "steps": len(self.steps), "reward": reward},
        )

    def _budget(self, req: Sampling, asked: int | None) -> int:
        if req.unsupported():
            raise CallError(400, str(req.unsupported()))
        calls = len(self.steps) + (self.pending is not None)
        if calls >= self.work.max_turns:
            self.spent = "max_turns"
            raise CallError(400, f"the job's max_turns ({self.work.max_turns}) are spent: finish the session")
        left = self.work.max_tokens - self.generated
        if left <= 0:
            self.spent = "max_tokens"
            raise CallError(
                400, f"the job's max_tokens ({self.work.max_tokens}) are spent: finish the session"
            )
        return min(left, self.work.max_turn_tokens or left, asked or left)

    async def _chat(self, req: ChatRequest) -> dict[str, Any]:
        want = self._budget(req, req.max_completion_tokens or req.max_tokens)
        if not req.messages:
            raise CallError(400, "messages: a chat needs at least one message")
        thinking = bool((req.chat_template_kwargs or {}).get("enable_thinking", True))
        n = len(self.chat_seen)
        pending = self.pending
        choice: int | None = None
        try:
            if (
                pending is not None
                and n
                and req.tools == self.tools
                and len(req.messages) > n + 1
                and all(_same(a, b) for a, b in zip(req.messages[:n], self.chat_seen, strict=False))
                and all(m.get("role") != "assistant" for m in req.messages[n + 1 :])
            ):
                replied = req.messages[n]
                choice = next((i for i, m in enumerate(pending.messages) if _same(replied, m)), None)
        except (chat.ChatError, AttributeError, TypeError):
            choice = None  # not the chat this session answered: rendered afresh (and refused if unreadable)
        try:
            if choice is not None:
                assert pending is not None
                new = req.messages[n + 1 :]
                out = pending.samples[choice].output_ids
                new_ids = chat.encode(chat.continuation(new, chat.ended(out), thinking))
                observation = chat.joined_text(new)
                context, rebased = pending.ids(choice) + new_ids, False
            else:
                context = new_ids = chat.encode(chat.render(req.messages, req.tools, True, thinking))
                observation, rebased = "", self.pending is not None or bool(self.steps)
        except chat.ChatError as e:
            raise CallError(400, str(e)) from e
        if not self.prompt:
            self.prompt = chat.text_of(req.messages[-1].get("content"))
        turn = await self._generate(req, context, new_ids, want, observation, rebased, choice)
        self.tools = req.tools
        calls = req.tools is not None and req.tool_choice != "none"
        self.chat_seen = list(req.messages)
        responses = []
        for sample in turn.samples:
            reply = chat.parse_reply(sample.text) if calls else chat.Reply(sample.text, [])
            turn.messages.append(chat.message(reply))
            finish = "tool_calls" if reply.tool_calls else sample.finish
            g = self._generated(sample, req, finish, context, bool(req.logprobs))
            responses.append(openai_api.chat_completion(g, reply))
        return responses[0] if len(responses) == 1 else openai_api.choices(responses)

    async def _completion(self, req: CompletionRequest) -> list[tuple[openai_api.Generated, str]]:
        want = self._budget(req, req.max_tokens)
        ids = list(req.prompt) if isinstance(req.prompt, list) else chat.encode(req.prompt)
        if not ids:
            raise CallError(400, "prompt: a completion needs a prompt")
        if not all(0 <= t < QWEN3_VOCAB for t in ids):
            raise CallError(400, f"prompt: token ids are 0 to {QWEN3_VOCAB - 1}")
        pending = self.pending
        choice = None
        if pending is not None:
            for i in range(len(pending.samples)):
                before = pending.ids(i)
                if len(ids) > len(before) and ids[: len(before)] == before:
                    choice = i
                    break
        if choice is not None:
            assert pending is not None
            new_ids, rebased = ids[len(pending.ids(choice)) :], False
            observation = chat.decode(new_ids)
        else:
            new_ids, rebased, observation = ids, self.pending is not None or bool(self.steps), ""
        if not self.prompt:
            self.prompt = chat.decode(ids)
        turn = await self._generate(req, ids, new_ids, want, observation, rebased, choice)
        self.chat_seen = []
        return [
            (self._generated(sample, req, sample.finish, ids, req.logprobs is not None), sample.text)
            for sample in turn.samples
        ]

    async def _text_completion(self, req: CompletionRequest) -> dict[str, Any]:
        responses = [openai_api.text_completion(g, text) for g, text in await self._completion(req)]
        return responses[0] if len(responses) == 1 else openai_api.choices(responses)

    async def _tokens(self, req: GenerateRequest) -> dict[str, Any]:
        """vLLM's token-in, token-out generate: a completion of the ids, answered in that route's shape."""
        try:
            completion = req.completion()
        except BadRequest as e:
            raise CallError(400, str(e)) from e
        return openai_api.generate_response([g for g, _ in await self._completion(completion)])

    def _generated(
        self,
        sample: _Sample,
        req: ChatRequest | CompletionRequest,
        finish: str,
        prompt: list[int],
        logprobs: bool,
    ) -> openai_api.Generated:
        return openai_api.Generated(
            sample.call.req.rid,
            req.model or self.work.model,
            int(time.time()),
            finish,
            prompt,
            sample.output_ids,
            sample.logprobs if logprobs else None,
            bool(req.return_token_ids),
            sample.top if logprobs and req.top() else None,
        )

    def _sample(self, mc: ModelCall, req: Sampling) -> _Sample:
        """A generation as returned and recorded: cut at the first of the agent's stops."""
        out = mc.res.output_ids
        if out is None:
            raise EnvError("the engine returned no token ids")
        lps, top = mc.res.output_logprobs, mc.res.output_top_logprobs
        if req.top() and top is None:
            raise CallError(400, "top_logprobs: the engine serving this call returns no top log-probs")
        stops, stop_ids = req.stops(), req.stop_token_ids or []
        cut = openai_api.cut_at_stop(out, stops, stop_ids) if stops or stop_ids else None
        if cut is None:
            return _Sample(mc, list(out), lps, top, chat.reply_text(out), False)
        k = cut.keep
        return _Sample(
            mc,
            list(out[:k]),
            None if lps is None else lps[:k],
            None if top is None else top[:k],
            cut.text,
            True,
        )

    async def _generate(
        self,
        req: Sampling,
        context: list[int],
        new_ids: list[int],
        want: int,
        observation: str,
        rebased: bool,
        choice: int | None = None,
    ) -> _Turn:
        # As vLLM answers past its max_model_len: no room is a refused call, too little cuts the reply.
        room = await context_room(self.ctx, self.work, len(context))
        if room is not None:
            if room < 1:
                raise CallError(
                    400,
                    f"the conversation is {len(context)} tokens, at or past the model's maximum context length "
                    f"of {len(context) + room} tokens",
                )
            want = min(want, room)
        now = self.ctx.clock.now()
        prev = self.pending
        k = len(self.steps) + (prev is not None)
        if k == 0:
            self.prompt_tokens = len(context)
        if prev is not None and prev.prediction is not None:
            self.priority = await await_prediction(
                self.ctx, self.work, k - 1, prev.prediction, self.priority, len(context), self.generated
            )
        sampling = msgspec.structs.replace(
            self.work.sampling,
            temperature=self.work.sampling.temperature if req.temperature is None else req.temperature,
            top_p=self.work.sampling.top_p if req.top_p is None else req.top_p,
            logprobs=True,  # the trajectory keeps them whether or not the agent asked
        )
        extra: dict[str, Any] = {
            "stop": req.stops(),
            "stop_token_ids": req.stop_token_ids,
            "top_logprobs": req.top(),
        }
        try:
            mcs = await _all(
                call_model(
                    self.ctx,
                    self.work,
                    k,
                    len(context),
                    want,
                    self.priority,
                    context,
                    sampling,
                    sample=i,
                    **extra,
                )
                for i in range(req.n or 1)
            )
        except GenFailed as e:
            if e.code == "invalid_request":  # the engine refused this call (too long): the session goes on
                raise CallError(400, str(e)) from e
            raise
        samples = [self._sample(mc, req) for mc in mcs]
        # The reply that came before is a step now, with what the agent sent after it.
        if prev is not None and choice is not None:
            prev.chosen = choice
        self._close_turn(observation, 0.0 if prev is None else now - prev.replied_at)
        # The trajectory grows by one of the samples: the budget counts the longest.
        self.generated += max(len(x.output_ids) for x in samples)
        self.acts.append(samples[0].text)
        turn = _Turn(samples, context, new_ids, self.ctx.clock.now(), rebased)
        pieces = predict_context.step_pieces(self.acts, [*self.observations, ""], k + 1)
        turn.prediction = asyncio.create_task(
            predict(
                self.ctx,
                self.work,
                k + 1,
                len(turn.ids(0)),
                self.generated,
                self.prompt,
                pieces,
                self.prompt_tokens,
            )
        )
        self.pending = turn
        return turn

    def _close_turn(self, observation: str, tool_s: float) -> None:
        """The pending reply becomes a step, with what the agent sent after it."""
        turn = self.pending
        if turn is None:
            return
        self.pending = None
        self.observations.append(observation)
        chosen = turn.samples[turn.chosen]
        step = chosen.call.step(
            chosen.text, observation, tool_s, turn.prompt_ids, chosen.output_ids, turn.rebased
        )
        siblings = [x.sibling(i) for i, x in enumerate(turn.samples) if i != turn.chosen]
        self.steps.append(
            msgspec.structs.replace(
                step,
                output_len=len(chosen.output_ids),
                output_logprobs=chosen.logprobs,
                choice=turn.chosen,
                siblings=siblings or None,
            )
        )

    def trajectory(self, started: float, finish: str = "finished", **verdict: Any) -> Trajectory:
        """The session's trajectory once it ended: its steps, and the reward it was finished with (``given``:
        else the job's reward function scores it), beside what else the ``verdict`` says."""
        given: dict[str, Any] = {"given": self.reward is not None}
        if self.reward is not None:
            given["score"] = self.reward
        info = {
            "verdict": {**given, **verdict},
            "rebased_steps": sum(s.rebased for s in self.steps),
            "sandbox": "none",
        }
        return trajectory(self.work, "completed", finish, self.steps, started, self.ctx.clock.now(), info)

    def cancel_prediction(self) -> None:
        if self.pending is not None and self.pending.prediction is not None:
            self.pending.prediction.cancel()

    async def wait(self) -> None:
        """Until the session ends; EnvError when the agent has been quiet for ``session_idle_s``."""
        while not self.ended.is_set():
            quiet = time.monotonic() - self.last_call
            left = self.work.session_idle_s - quiet
            if left <= 0 and not self.busy:
                raise EnvError(f"the agent sent no call for {self.work.session_idle_s:g} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ended.wait(), max(left, 0.5))


async def _all(calls: Iterable[Coroutine[Any, Any, ModelCall]]) -> list[ModelCall]:
    """Every call's result, in order; when one fails (or this is cancelled) the others are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def run_external(work: TrajWork, ctx: LoopContext) -> Trajectory:
    session = Session(work, ctx)
    started = ctx.clock.now()
    sub = await ctx.nc.subscribe(subjects.session(work.job_id, work.traj_id), cb=session.on_msg)
    try:
        await session.wait()
    finally:
        with contextlib.suppress(Exception):
            if session.ended.is_set():
                # Calls queued behind the last one still get their answer (409: the session has ended).
                await asyncio.wait_for(sub.drain(), 5.0)
            else:  # torn down (cancelled, quiet): the call in flight, if any, is told so as it stops
                await sub.unsubscribe()
        session.cancel_prediction()
    if session.failure is not None:
        raise session.failure
    return session.trajectory(started)

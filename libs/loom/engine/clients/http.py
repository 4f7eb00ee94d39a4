"""What the SGLang and vLLM clients share: one aiohttp session per server, a poller of its load, the
token-id contexts Loom replays, the checkpoint paths of a weight update, and HTTP calls whose failures raise
the client's own error (a bad request: ``ValueError``). Each client adds its server's API."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp
import msgspec

from loom.engine.base import EngineInfo, EngineLoad, EngineOutput, EngineRequest
from loom.engine.token_ids import QWEN3_ORDINARY, ContextIds
from loom.protocol import WeightsRef
from loom.weights import Incoming

if TYPE_CHECKING:  # torch, only where weights move: the CLI imports the clients and starts without it
    import torch

    from loom.weights.collective import Format

log = logging.getLogger(__name__)

# A version that came (or comes, from a store at the commit) by broadcast rather than from a checkpoint path.
BROADCAST = ""
# The relay of a store's version runs on this machine's loopback: the server is beside its worker.
RELAY_HOST = "127.0.0.1"
RELAY_TIMEOUT_S = 600.0


def max_model_len(url: str, models: Any) -> int:
    """The longest context a server takes, from its ``GET /v1/models`` (vLLM's and SGLang's cards carry it as
    ``max_model_len``); 0 when it gives none."""
    cards = models.get("data") if isinstance(models, dict) else None
    value = cards[0].get("max_model_len") if cards and isinstance(cards[0], dict) else None
    if value is None:
        log.warning("%s/v1/models gives no max_model_len: Loom cannot keep contexts within it", url)
        return 0
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{url}/v1/models: max_model_len must be a positive integer, got {value!r}")
    return value


class HTTPEngine:
    # The server's name in messages, the ``EngineInfo.kind`` the worker reports, and what its failures raise.
    server: ClassVar[str]
    kind: ClassVar[str]
    error: ClassVar[type[RuntimeError]]
    # How the server takes a broadcast, best first (loom.weights.collective.FORMATS).
    weight_formats: ClassVar[tuple[Format, ...]]

    def __init__(
        self,
        url: str,
        model: str = "qwen3-8b",
        gpu: str = "h100",
        poll_s: float = 0.5,
        vocab: int = QWEN3_ORDINARY,
    ) -> None:
        self.url = url.rstrip("/")
        # ``model`` is Loom's name for what the server runs (placement keys on it); the server has its own.
        # The real figures replace these in start(); until then the worker reports an empty engine.
        self.info = EngineInfo(
            kind=self.kind, model=model, gpu=gpu, tp=1, max_running=0, kv_capacity_tokens=0
        )
        self.poll_s = poll_s
        self.vocab = vocab
        self.weight_version = ""
        # The checkpoint the server serves and the one before the last commit: a fleet whose update failed on
        # another worker loads the previous one back.
        self.serving_path = ""
        self.previous_path = ""
        self._pending: dict[
            str, str
        ] = {}  # checkpoint paths prepared (BROADCAST: no path), by weight version
        self._fetched: dict[
            str, dict[str, torch.Tensor]
        ] = {}  # store versions fetched, to relay at the commit
        self._paused = False
        # The server's prefix cache still holds KV computed by old weights (a commit could not drop it):
        # dropped once this client has nothing in flight.
        self._stale_cache = False
        self._priority_sign = 0  # 0: the server ignores priorities, so none is sent
        self._contexts = ContextIds(0, vocab)
        self._inflight: set[str] = set()
        self._warm_ids = itertools.count()
        self._load = EngineLoad(0, 0, 0, 0, 0)
        self._session: aiohttp.ClientSession | None = None
        self._warned: set[str] = set()
        self._poller: asyncio.Task[None] | None = None

    # What each server does its own way

    def _warn_once(self, what: str, message: str) -> None:
        """Log ``message`` (its ``%s`` the server's URL) the first time ``what`` is met: a server started without
        a feature the client reads says so once, not per request."""
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, self.url)

    async def _handshake(self) -> None:
        """Read the server's model and settings at start; raise where Loom cannot use it."""
        raise NotImplementedError

    async def _poll_once(self) -> EngineLoad:
        raise NotImplementedError

    async def _abort_inflight(self) -> None:
        """Abort every request this client has in flight (at close)."""
        raise NotImplementedError

    async def generate(self, req: EngineRequest) -> EngineOutput:
        raise NotImplementedError

    @staticmethod
    def _message(text: str) -> str:
        """The message of an error body: {"error": {"message"}} or {"error": "..."} (vLLM's RL routes),
        {"message"} or {"detail"} (FastAPI), else the text."""
        try:
            body = json.loads(text)
        except ValueError:
            return text.strip()
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            if isinstance(err, str):
                return err
            for key in ("message", "detail"):
                if key in body:
                    return str(body[key])
        return text.strip()

    # Life cycle

    async def start(self) -> None:
        if self._session is not None:
            return
        # No connection limit: aiohttp's default of 100 would cap the batch below the server's.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        try:
            await self._handshake()
            self._load = await self._poll_once()
        except BaseException:
            await self._session.close()
            self._session = None
            raise
        self._poller = asyncio.create_task(self._poll(), name=f"{self.kind}-poll-{self.url}")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        if self._session is None:
            return
        if self._inflight:
            with contextlib.suppress(self.error, ValueError):
                await self._abort_inflight()
        await self._session.close()
        self._session = None

    def load(self) -> EngineLoad:
        return self._load

    async def warm_prefix(self, prefix_key: str, input_len: int) -> None:
        # Neither server imports KV: a request that generates nothing (vLLM: one token, dropped) leaves the
        # context in its prefix cache.
        rid = f"warm-{next(self._warm_ids)}:{prefix_key}"
        await self.generate(
            EngineRequest(rid=rid, input_len=input_len, max_new_tokens=0, prefix_key=prefix_key)
        )

    # Weights: both servers load in place, nothing beside the serving ones. A checkpoint loads at the commit; a
    # broadcast arrives at the prepare (inside the fleet's pause), through the server's own routes, the
    # server joining the trainer's group; a store's version is fetched here while the server generates and
    # broadcast from here to the server at the commit (this process as the group's rank 0).

    async def prepare_weights(self, version: str, weights: Incoming) -> None:
        ref = weights.ref
        if ref.transport == "collective":
            await self._joined(version, ref, weights.timeout_s)
            self._pending[version] = BROADCAST
            return
        if ref.transport == "store":
            self._fetched[version] = await weights.tensors()
            self._pending[version] = BROADCAST
            return
        path = weights.path
        if not path:
            raise ValueError(f"weight version {version!r} needs a checkpoint path for {self.server} to load")
        self._pending[version] = path

    async def _joined(self, version: str, ref: WeightsRef, timeout_s: float) -> None:
        """Announce this worker in the update's store, have the server take the broadcast through its routes
        (``_take``), and mark it done; a failure tells the trainer at once."""
        from loom.weights import collective

        store = await asyncio.to_thread(collective.connect, ref.address, timeout_s)
        # The server joins with a rank per GPU of its tensor parallelism, from ``ref.rank`` on.
        ranks = range(ref.rank, ref.rank + self.info.tp)
        for r in ranks:
            collective.announce(store, r, ref.world_size, self.weight_formats)
        try:
            fmt = await asyncio.to_thread(collective.agreed, store, timeout_s)
            await self._take(version, ref, fmt)
        except BaseException as e:
            for r in ranks:
                collective.failed(store, r, e)
            raise
        for r in ranks:
            collective.done(store, r)

    async def _take(self, version: str, ref: WeightsRef, fmt: Format) -> None:
        """The server takes the broadcast as ``fmt``, through its own routes."""
        raise NotImplementedError

    async def _relay(self, version: str) -> None:
        """A store's version, fetched at the prepare, broadcast from this process to the server."""
        from loom.weights.collective import Sender

        state = self._fetched.pop(version)
        sender = Sender(host=RELAY_HOST)
        ref = sender.ref(state)
        mine = msgspec.structs.replace(ref, rank=1, world_size=1 + self.info.tp)
        sending = asyncio.ensure_future(asyncio.to_thread(sender.send, ref, state, RELAY_TIMEOUT_S))
        try:
            await self._joined(version, mine, RELAY_TIMEOUT_S)
        except BaseException:
            sender.cancel(ref)
            raise
        await sending

    def _prepared(self, version: str) -> str:
        path = self._pending.get(version)
        if path is None:
            raise RuntimeError(f"weight version {version!r} was not prepared")
        return path

    def _committed(self, version: str, path: str) -> None:
        del self._pending[version]
        self.previous_path, self.serving_path = self.serving_path, path
        self.weight_version = version

    async def discard_weights(self, version: str) -> None:
        self._pending.pop(version, None)
        self._fetched.pop(version, None)

    # Load

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                async with asyncio.timeout(max(10.0, self.poll_s)):
                    self._load = await self._poll_once()
            except (self.error, ValueError, TimeoutError) as e:
                log.warning("load poll of %s failed, keeping the last figures: %r", self.url, e)

    # HTTP

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        text = await self._text(method, path, body)
        return json.loads(text) if text else {}

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"{type(self).__name__} is not running: await start() first")
        return self._session

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[str, int, str]:
        """The URL, HTTP status and body text of one call; a connection failure is the client's error."""
        session = self._require_session()
        url = self.url + path
        try:
            async with session.request(method, url, json=body) as resp:
                return url, resp.status, await resp.text()
        except aiohttp.ClientError as e:
            raise self.error(f"{method} {url}: {e}") from e

    async def _text(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        url, status, text = await self._request(method, path, body)
        if status == 400:
            raise ValueError(f"{method} {url}: HTTP 400: {self._message(text)}")
        if status >= 300:
            raise self.error(f"{method} {url}: HTTP {status}: {self._message(text)}")
        return text

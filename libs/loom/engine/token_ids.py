"""Token ids and prefix keys: Loom names a trajectory's cached context by a prefix key, engines by its ids.

Trace replay carries only lengths. A real engine caches by ids, and two requests of one trajectory share a
cached prefix only if the second repeats the first's ids, including the tokens the engine generated, as on
real text. So the ids of a context are the last context the trajectory sent (its input and the engine's
output), then a pseudo-random stream of its prefix key beyond (``synth_ids``, ``ContextIds``). The
simulator, caching by key, goes the other way when it serves SGLang's API (``ContextKeys``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import struct
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Qwen3's embedding has 151,936 rows; ids from 151,643 up are special tokens (<|endoftext|>, chat markers)
# that would change how the model reads its context, so the stream uses only the ordinary ones.
QWEN3_VOCAB = 151_936
QWEN3_ORDINARY = 151_643

_SYNTH_BLOCK = 16  # ids per 64-byte BLAKE2b digest
_WORDS = struct.Struct(f"<{_SYNTH_BLOCK}I")
_KV_BLOCK = 64  # ids per hashed block in the key index


def synth_ids(key: str, n: int, start: int = 0, vocab: int = QWEN3_ORDINARY) -> list[int]:
    """Ids ``start`` to ``start + n`` of ``key``'s endless stream: a prefix of every longer call's result.

    Each block of the stream is a hash of (key, block index), so any window costs O(n) and the same key
    yields the same ids in every process."""
    if n <= 0:
        return []
    seed = hashlib.blake2b(key.encode(), digest_size=32).digest()
    first, last = start // _SYNTH_BLOCK, (start + n - 1) // _SYNTH_BLOCK
    ids: list[int] = []
    for block in range(first, last + 1):
        digest = hashlib.blake2b(block.to_bytes(8, "little"), digest_size=64, key=seed).digest()
        ids.extend(w % vocab for w in _WORDS.unpack(digest))
    offset = start - first * _SYNTH_BLOCK
    return ids[offset : offset + n]


def ids_key(ids: Sequence[int]) -> str:
    """A stream key of a context's ids: a simulated engine's output for a context is this key's stream."""
    return hashlib.blake2b(array("I", ids).tobytes(), digest_size=16).hexdigest()


def seed63(text: str) -> int:
    """A sampling seed named by ``text``: 63 bits of its hash, what torch's ``manual_seed`` and vLLM's
    per-request ``seed`` (a signed 64-bit integer) both take."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_of(ids: Sequence[int], request_id: str, seed: int | None = None) -> str:
    """A request's draw: its prompt and id, so that siblings of one prompt sample apart and a retry repeats; or
    its prompt and its own seed where it gives one, so that any request of that seed and prompt repeats it."""
    return f"{ids_key(ids)}/{request_id}" if seed is None else f"{ids_key(ids)}/seed {seed}"


def synth_logprobs(key: str, n: int) -> list[float]:
    """``n`` placeholder log-probabilities, each the log of a uniform draw in (0, 1] from ``key``'s stream:
    at most 0, about -1 on average, the same for the same key."""
    return [math.log((w + 1) / 2**32) for w in synth_ids(key, n, vocab=2**32)]


def synth_top_logprobs(
    key: str, ids: Sequence[int], logprobs: Sequence[float], k: int, vocab: int = QWEN3_ORDINARY
) -> list[list[tuple[int, float]]]:
    """Placeholder top-``k`` alternatives of each sampled token, best first: the sampled token with its
    log-prob and ``k`` - 1 others of ``key``'s stream sharing the rest of the mass (half, a quarter, ...), so
    every position's probabilities sum to at most 1 and the sampled token is always among them."""
    if k <= 0:
        return []
    alts = synth_ids(key, len(ids) * (k - 1), vocab=vocab)
    out: list[list[tuple[int, float]]] = []
    for i, (t, lp) in enumerate(zip(ids, logprobs, strict=True)):
        rest = max(1.0 - math.exp(lp), 1e-12)
        row = [(t, lp)]
        for j, a in enumerate(alts[i * (k - 1) : (i + 1) * (k - 1)]):
            row.append((a if a != t else (a + 1) % vocab, math.log(rest / 2 ** (j + 1))))
        row.sort(key=lambda e: -e[1])
        out.append(row)
    return out


class ContextIds:
    """The ids each trajectory's context was last sent as, least recently used first, ``capacity`` ids in all.

    An engine cannot hold more than its KV capacity anyway, so a trajectory forgotten here has lost its
    cached prefix there too; it then falls back to its key's stream and still hits its first prompt."""

    def __init__(self, capacity: int, vocab: int = QWEN3_ORDINARY) -> None:
        self.capacity = capacity
        self.vocab = vocab
        self._ids: OrderedDict[str, array[int]] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return self._total

    def build(self, key: str, input_len: int) -> list[int]:
        """``input_len`` ids: the remembered context of ``key`` (cut to length), then its stream."""
        known = self._ids.get(key)
        head = known[:input_len].tolist() if known is not None else []
        if known is not None:
            self._ids.move_to_end(key)
        return head + synth_ids(key, input_len - len(head), start=len(head), vocab=self.vocab)

    def remember(self, key: str, ids: Sequence[int]) -> None:
        old = self._ids.pop(key, None)
        if old is not None:
            self._total -= len(old)
        if len(ids) > self.capacity:
            return
        self._ids[key] = array("I", ids)
        self._total += len(ids)
        while self._total > self.capacity:
            _, dropped = self._ids.popitem(last=False)
            self._total -= len(dropped)


@dataclass(slots=True)
class _Recorded:
    length: int
    boundary: bytes  # chain hash of the whole blocks
    tail: array[int]  # the ids after them


class ContextKeys:
    """The inverse, for an engine that caches by prefix key (the simulator behind an SGLang-compatible API):
    names the key whose recorded ids a request's ids extend, the longest such, else a new key.

    A key stands for one trajectory's growing context. A key with a request still running is not taken:
    that request is a sibling with the same prompt, and its outputs would overwrite the trajectory's. What
    is recorded for a key only ever grows, so the engine's cached prefix of a key is a prefix of it.

    Ids are indexed as vLLM and SGLang index KV blocks: by a hash chain over whole blocks, so a lookup costs
    one hash per block of the request plus one comparison of at most a block's ids per candidate."""

    def __init__(self, capacity: int) -> None:
        # Keys beyond the engine's KV capacity, least recently used, have lost their cache there anyway.
        self.capacity = capacity
        self._keys: OrderedDict[str, _Recorded] = OrderedDict()
        self._buckets: dict[bytes, set[str]] = {}
        self._busy: Counter[str] = Counter()
        self._total = 0
        self._names = itertools.count()

    def acquire(self, ids: Sequence[int]) -> str:
        """The key for a request of ``ids``, held until ``release``."""
        arr = array("I", ids)
        chain = _chain(arr)
        key = self._match(arr, chain) or f"ctx-{next(self._names)}"
        self._busy[key] += 1
        self._record(key, arr, chain)
        return key

    def release(self, key: str, ids: Sequence[int]) -> None:
        """The request on ``key`` ended with ``ids`` computed (its input, then what it generated)."""
        self._busy[key] -= 1
        if not self._busy[key]:
            del self._busy[key]
        arr = array("I", ids)
        self._record(key, arr, _chain(arr))

    def clear(self) -> None:
        self._keys.clear()
        self._buckets.clear()
        self._total = 0

    def _match(self, arr: array[int], chain: list[bytes]) -> str | None:
        for blocks in range(len(chain) - 1, -1, -1):
            start = blocks * _KV_BLOCK
            best, best_len = None, -1
            for key in self._buckets.get(chain[blocks], ()):
                rec = self._keys[key]
                if key in self._busy or not best_len < rec.length <= len(arr):
                    continue
                if arr[start : rec.length] == rec.tail:
                    best, best_len = key, rec.length
            if best is not None:
                return best
        return None

    def _record(self, key: str, arr: array[int], chain: list[bytes]) -> None:
        old = self._keys.pop(key, None)
        if old is not None:
            self._forget(key, old)
        blocks = len(arr) // _KV_BLOCK
        rec = _Recorded(len(arr), chain[blocks], arr[blocks * _KV_BLOCK :])
        self._keys[key] = rec
        self._buckets.setdefault(rec.boundary, set()).add(key)
        self._total += rec.length
        while self._total > self.capacity:
            oldest, dropped = self._keys.popitem(last=False)
            self._forget(oldest, dropped)

    def _forget(self, key: str, rec: _Recorded) -> None:
        self._total -= rec.length
        bucket = self._buckets[rec.boundary]
        bucket.discard(key)
        if not bucket:
            del self._buckets[rec.boundary]


def _chain(arr: array[int]) -> list[bytes]:
    """Hashes of the first 0, 1, 2, ... whole blocks of ``arr``, each chained on the one before."""
    data = arr.tobytes()
    step = _KV_BLOCK * arr.itemsize
    chain = [b""]
    for start in range(0, len(arr) // _KV_BLOCK * step, step):
        chain.append(hashlib.blake2b(chain[-1] + data[start : start + step], digest_size=16).digest())
    return chain

"""``coin``: a small multi-turn game with a tool, meant for RL of a tiny policy on a CPU.

N boxes (4 to 9), a coin in one of them, and a true clue about where it is. The agent opens boxes with the
``open`` tool (``Open[3]``, or ``<tool_call>{"name": "open", "arguments": {"box": 3}}</tool_call>``) and has
``N // 2`` tries: opening boxes at random without repeats finds the coin with probability ``tries / N``
(0.40 to 0.50; 0.47 over the task mix), while play that follows the clue and never opens a box twice always
finds it, since every clue leaves 2 to ``tries`` boxes. Every box number is a single token.

The clue names a property of the coin's box number (even, odd, prime, square, a multiple of three) in one of
five phrasings (``The coin is in an even-numbered box.``, ``Look in the boxes with prime numbers.``, ...), and the
prompt opens with one of twelve sentences (``Find the coin.``, ``A coin is hidden in one of the boxes.``, ...):
1,380 distinct prompts, so that a held-out set can have hundreds of them. The
game ends with reward 1 when a box holds the coin, and with reward 0 when the tries run out or a call is not a
valid ``open`` of an existing box (the observation says what was wrong). Opening a box again is legal, costs a
try, and reads as the first time did.

Task sets are generated deterministically: ``coin`` (training) and ``coin-eval`` (held out). A fixed share of
each clue kind's games (box count and clue phrasing) is held out with all twelve openings: no held-out game
is seen in training under any opening. The held-out games take the clue kinds in turn and each kind's prompts
in a seeded order, so the first ones all show different prompts (the first 240 do).
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any

from msgspec import Struct

from loom.envs.actions import ParseError, ToolCall, json_call, parse
from loom.envs.base import Observation

TOOLS = ("open",)
INSTRUCTION = "Reply Open[N] to open box N."
# The prompt's first sentence: it says nothing the game needs, so it varies the prompts (and the positions of
# everything after it) without changing what a player must read.
OPENINGS = (
    "Find the coin.",
    "A coin is hidden in one of the boxes.",
    "Somewhere in these boxes is a coin.",
    "There is a coin in one box.",
    "Your task: find the hidden coin.",
    "One of the boxes holds a coin.",
    "Look for the coin.",
    "Which box has the coin?",
    "A single coin lies in one box.",
    "Find the box with the coin in it.",
    "The coin is in one of these boxes.",
    "Search the boxes for the coin.",
)
BOXES = range(4, 10)
# Each clue names a property of the coin's box number, in one of several phrasings. Clues that list box numbers
# ("in box 2, 5 or 7", "not in box 1 or 4") were tried and left out: trained for 300-400 steps on demonstrations
# that follow the clue, the small policy (2 layers, hidden 64) put 0.7-0.8 of its probability on the allowed
# boxes for property clues and about chance (0.3) for listed numbers, which need copying digits from the context.
PROPERTIES: dict[str, frozenset[int]] = {
    "even": frozenset({2, 4, 6, 8}),
    "odd": frozenset({1, 3, 5, 7, 9}),
    "prime": frozenset({2, 3, 5, 7}),
    "square": frozenset({1, 4, 9}),
    "three": frozenset({3, 6, 9}),
}
PHRASINGS: dict[str, tuple[str, ...]] = {
    "even": (
        "The coin is in an even-numbered box.",
        "The number of the coin's box is even.",
        "Look in the boxes with even numbers.",
        "The coin's box has an even number.",
        "The coin is not in an odd-numbered box.",
    ),
    "odd": (
        "The coin is in an odd-numbered box.",
        "The number of the coin's box is odd.",
        "Look in the boxes with odd numbers.",
        "The coin's box has an odd number.",
        "The coin is not in an even-numbered box.",
    ),
    "prime": (
        "The coin is in a box whose number is prime.",
        "The number of the coin's box is a prime.",
        "Look in the boxes with prime numbers.",
        "The coin's box has a prime number.",
        "The coin is in a prime-numbered box.",
    ),
    "square": (
        "The coin is in a box whose number is a square.",
        "The number of the coin's box is a perfect square.",
        "Look in the boxes with square numbers.",
        "The coin's box has a square number.",
        "The coin is in a square-numbered box.",
    ),
    "three": (
        "The coin is in a box whose number is a multiple of three.",
        "The number of the coin's box is divisible by three.",
        "Look in the boxes with numbers divisible by three.",
        "The coin's box has a number that is a multiple of three.",
        "The coin is in a box numbered with a multiple of three.",
    ),
}
KINDS = tuple(PROPERTIES)
# Tasks per split, and the share of each clue kind's games held out for evaluation (a quarter: the rarest kind,
# odd, then has 48 held-out prompts, so 200 games taking the kinds in turn all show different prompts).
SIZES = {"train": 4000, "eval": 400}
EVAL_SHARE = 0.25
_SEEDS = {"split": 20_251, "train": 1, "eval": 2}
_BOX_ARG = re.compile(r"\s*(?:box\s*)?(\d{1,3})\s*\.?\s*", re.I)


class CoinTask(Struct, frozen=True):
    """One game: ``boxes`` boxes numbered from 1, the coin's box, ``tries`` opens, and the clue: the property
    ``kind`` of the coin's box number (a key of ``PROPERTIES``) in phrasing number ``phrasing``."""

    id: str
    boxes: int
    tries: int
    kind: str
    phrasing: int
    coin: int
    # Which of ``OPENINGS`` the prompt starts with.
    opening: int = 0

    @property
    def clue(self) -> str:
        return PHRASINGS[self.kind][self.phrasing]

    @property
    def question(self) -> str:
        """What the prompt says of this game (everything but the coin): the task's statement."""
        return f"Boxes 1 to {self.boxes}, {self.tries} tries.\nClue: {self.clue}"

    def candidates(self) -> tuple[int, ...]:
        """The boxes the clue allows, in order."""
        return allowed(self.boxes, self.kind)


def allowed(boxes: int, kind: str) -> tuple[int, ...]:
    """The boxes of ``1..boxes`` whose number has the property ``kind``."""
    return tuple(b for b in range(1, boxes + 1) if b in PROPERTIES[kind])


def tries_for(boxes: int) -> int:
    return boxes // 2


def kinds_for(boxes: int) -> list[str]:
    """The clue kinds that leave 2 to ``tries`` boxes of ``boxes``: a clue-following player always wins, and
    the clue is never the answer itself."""
    return [k for k in KINDS if 2 <= len(allowed(boxes, k)) <= tries_for(boxes)]


Prompt = tuple[int, str, int, int]  # (boxes, kind, phrasing, opening): what the prompt shows


def _prompts_by_split() -> dict[str, dict[str, list[Prompt]]]:
    """Each clue kind's distinct prompts by split: its games (box count and phrasing) shuffled (seeded), the
    first ``EVAL_SHARE`` (at least one) held out, each under every opening; each list shuffled (seeded)."""
    rng = random.Random(_SEEDS["split"])
    split: dict[str, dict[str, list[Prompt]]] = {"train": {}, "eval": {}}
    for kind in KINDS:
        games = [(n, kind, i) for n in BOXES if kind in kinds_for(n) for i in range(len(PHRASINGS[kind]))]
        rng.shuffle(games)
        cut = max(1, round(EVAL_SHARE * len(games)))
        for name, part in (("eval", games[:cut]), ("train", games[cut:])):
            mine = [(*g, o) for g in part for o in range(len(OPENINGS))]
            rng.shuffle(mine)
            split[name][kind] = mine
    return split


@functools.cache
def coin_tasks(split: str = "train") -> dict[str, CoinTask]:
    """The generated games of ``split`` (``train``: data set ``coin``; ``eval``: ``coin-eval``), by id, in order.

    A training game draws a clue kind uniformly and one of that kind's prompts; held-out game ``i`` takes kind
    ``i mod 5`` and that kind's prompts in turn (each kind's list, already shuffled, cycled), so a prefix of the
    held-out set repeats no prompt while it can. The coin lies uniformly among the boxes the clue allows;
    everything is seeded, so the sets are the same on every machine."""
    if split not in SIZES:
        raise KeyError(f"unknown coin split {split!r}; known: {sorted(SIZES)}")
    prompts = _prompts_by_split()[split]
    rng = random.Random(_SEEDS[split])
    name = "coin" if split == "train" else "coin-eval"
    out: dict[str, CoinTask] = {}
    for i in range(SIZES[split]):
        if split == "train":
            n, kind, phrasing, opening = rng.choice(prompts[rng.choice(KINDS)])
        else:
            mine = prompts[KINDS[i % len(KINDS)]]
            n, kind, phrasing, opening = mine[(i // len(KINDS)) % len(mine)]
        coin = rng.choice(allowed(n, kind))
        t = CoinTask(f"{name}/{i}", n, tries_for(n), kind, phrasing, coin, opening)
        out[t.id] = t
    return out


def prompt(task: CoinTask) -> str:
    """The prompt ``CoinEnv.reset()`` returns."""
    return f"{OPENINGS[task.opening]} {INSTRUCTION}\n{task.question}\n"


def open_action(box: int, form: str = "react") -> str:
    """How a policy writes "open ``box``": ReAct (``react``: ``Open[3]``, 4 tokens) or the Qwen3 tool call
    (``json``, 23 tokens)."""
    if form == "json":
        return json_call("open", box=box)
    if form == "react":
        return f"Open[{box}]"
    raise ValueError(f"unknown action form {form!r}: json or react")


_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def sloppy_action(box: int, form: str = "react") -> str:
    """A careless call for ``box``: its number written as a word (``Open[three]``), which ``open`` does not
    take, so the game ends with reward 0."""
    if form == "json":
        return json_call("open", box=_WORDS[box])
    return f"Open[{_WORDS[box]}]"


def blind_play(task: CoinTask, rng: random.Random) -> list[int]:
    """A legal play that ignores the clue: distinct boxes in random order until the coin or the last try."""
    order = rng.sample(range(1, task.boxes + 1), task.boxes)[: task.tries]
    return order[: order.index(task.coin) + 1] if task.coin in order else order


def clue_play(task: CoinTask, rng: random.Random | None = None) -> list[int]:
    """Play that follows the clue: the allowed boxes (in random order when ``rng`` is given) until the coin."""
    order = list(task.candidates())
    if rng is not None:
        rng.shuffle(order)
    return order[: order.index(task.coin) + 1]


def box_of(arguments: dict[str, Any]) -> int | None:
    """The box an ``open`` call names: ``{"box": 3}``, ``{"box": "3"}`` or ReAct's ``{"input": "3"}``."""
    value = arguments.get("box", arguments.get("input"))
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _BOX_ARG.fullmatch(value)
        return int(m.group(1)) if m else None
    return None


def reference_actions(task: CoinTask) -> list[str]:
    return [open_action(b) for b in blind_play(task, random.Random(task.id))]


class CoinEnv:
    name = "coin"

    def __init__(self, task: CoinTask) -> None:
        self.task = task
        self.opened: list[int] = []
        self.done = False
        self.found = False
        self.reason = "unfinished"

    def _end(self, text: str, found: bool, reason: str) -> Observation:
        self.done, self.found, self.reason = True, found, reason
        return Observation(text, done=True)

    async def reset(self) -> str:
        self.opened, self.done, self.found, self.reason = [], False, False, "unfinished"
        return prompt(self.task)

    def act(self, call: ToolCall) -> Observation:
        """``step`` without the coroutine (for scripted sequences and offline loops)."""
        t = self.task
        if self.done:
            return Observation("The game is over.", done=True)
        if call.name.lower() != "open":
            return self._end(
                f"Unknown tool {call.name!r}: the only tool is open. The game is over.", False, "unknown tool"
            )
        box = box_of(call.arguments)
        if box is None:
            shown = call.arguments.get("box", call.arguments.get("input"))
            return self._end(
                f"open needs a box number from 1 to {t.boxes}, not {shown!r}. The game is over.",
                False,
                "no box number",
            )
        if not 1 <= box <= t.boxes:
            return self._end(
                f"There is no box {box}: the boxes are numbered 1 to {t.boxes}. The game is over.",
                False,
                "no such box",
            )
        self.opened.append(box)
        if box == t.coin:
            return self._end(f"Box {box} holds the coin!", True, "found")
        # A box opened again reads as the first time: the try is wasted, and the history already says so.
        text = f"Box {box} is empty."
        if len(self.opened) >= t.tries:
            return self._end(f"{text} No tries left: the game is over.", False, "out of tries")
        return Observation(text)

    async def step(self, call: ToolCall) -> Observation:
        return self.act(call)

    def reference_actions(self) -> list[str]:
        """A legal play that ignores the clue (distinct boxes, seeded by the task id) as ``Open[N]`` calls, as
        the warm start's demonstrator plays half of its games. It finds the coin in ``tries / boxes`` of games
        on average (a script that does not find it ends when the tries run out)."""
        return reference_actions(self.task)

    def verdict(self) -> dict[str, Any]:
        """``score`` 1.0 when the coin was found; ``reason`` is ``found``, ``out of tries``, what made the last
        call invalid, or ``unfinished`` (the trajectory stopped first, e.g. on its turn budget)."""
        return {
            "score": float(self.found),
            "found": self.found,
            "reason": self.reason,
            "opened": list(self.opened),
            "coin": self.task.coin,
            "tries": self.task.tries,
        }

    async def close(self) -> None:
        pass


# ---------------------------------------------------------------- baselines a trained policy is measured against


def random_value(task: CoinTask) -> float:
    """The chance that distinct boxes opened at random find the coin: ``tries / boxes``."""
    return task.tries / task.boxes


def fixed_orders(train: list[CoinTask]) -> dict[int, list[int]]:
    """The best clue-blind play: for each box count, one order of boxes for every game, the boxes where the
    coin lay most often in ``train`` first (ties by number)."""
    counts: dict[int, dict[int, int]] = {}
    for t in train:
        c = counts.setdefault(t.boxes, dict.fromkeys(range(1, t.boxes + 1), 0))
        c[t.coin] += 1
    return {n: sorted(c, key=lambda b: (-c[b], b)) for n, c in counts.items()}


def fixed_order_value(task: CoinTask, orders: dict[int, list[int]]) -> float:
    order = orders.get(task.boxes, list(range(1, task.boxes + 1)))
    return float(task.coin in order[: task.tries])


def play_value(task: CoinTask, calls: list[str]) -> float:
    """The reward of playing ``calls`` (``Open[N]`` texts, careless ones included) in this game."""
    env = CoinEnv(task)
    for text in calls:
        try:
            obs = env.act(parse(text))
        except ParseError:
            return 0.0
        if obs.done:
            break
    return float(env.found)


def clue_consistent(task: CoinTask, opened: list[int]) -> tuple[int, int]:
    """How many of the boxes opened the clue allows, and how many were opened."""
    allowed_boxes = set(task.candidates())
    return sum(b in allowed_boxes for b in opened), len(opened)

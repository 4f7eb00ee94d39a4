"""How a live trajectory's context grows, in token ids, so that training sees exactly what the engine saw.

The context of call k is the prompt's ids, then for every earlier call its output ids exactly as the engine
produced them (the stop token included; never decoded and encoded again) and the ids of the observation
text that followed. A supervised warm start builds its sequences with the same functions.
"""

from __future__ import annotations

from loom.text.tokenizer import STOP_IDS, qwen_tokenizer


def encode(text: str) -> list[int]:
    return qwen_tokenizer().encode(text, disallowed_special=())


def observation_ids(observation: str) -> list[int]:
    """The ids appended after a call's output: its tool's observation, on a line of its own."""
    return encode(f"\nObservation: {observation}\n")


def action_text(output_ids: list[int]) -> str:
    """The text of a call's output ids, special tokens (the stop token) left out."""
    ordinary = [t for t in output_ids if t < STOP_IDS[0]]
    return qwen_tokenizer().decode(ordinary)

"""Supervised sequences from chats: a policy learns to write the assistant turns of OpenAI-style chats
(with tools) exactly as a live trajectory would hold them.

A chat becomes one sequence built as the environment manager and the gateway grow a context
(``loom.text.chat``): Qwen3's template over the messages before the first assistant turn, then each assistant
turn as the model writes it with its end token (the loss is on these), then what follows it as
``continuation`` renders it. ``loom.trainer.warmstart.fit`` trains on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loom.text import chat
from loom.text.tokenizer import IM_END
from loom.trainer.grpo import Flat


def chat_sequence(messages: Sequence[chat.Message], tools: Sequence[dict[str, Any]] | None = None) -> Flat:
    """The chat as one sequence with the loss on its assistant turns; ValueError without any."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a chat to learn from has a prompt, then assistant turns")
    ids = chat.encode(chat.render(messages[:first], tools))
    mask = [0.0] * len(ids)
    i = first
    while i < len(messages):
        out = [*chat.encode(chat.assistant_text(messages[i])), IM_END]
        ids += out
        mask += [1.0] * len(out)
        j = i + 1
        while j < len(messages) and messages[j].get("role") != "assistant":
            j += 1
        if j > i + 1:
            follow = chat.encode(chat.continuation(messages[i + 1 : j], ended=True))
            ids += follow
            mask += [0.0] * len(follow)
        i = j
    return Flat(
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(mask, dtype=torch.float32),
        torch.zeros(len(ids), dtype=torch.float32),
    )

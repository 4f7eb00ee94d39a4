"""The Qwen tokenizer (byte-level BPE ranks shipped in ../shared/data/tokenizer), loaded offline with tiktoken.

Qwen2 and Qwen3 share these ordinary tokens; the pre-tokenisation pattern is Qwen's.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from loom.settings import default_shared_dir

# Qwen's added tokens follow its 151,643 ordinary ones, in this order (Qwen2.5 and Qwen3 alike). The chat
# markers and the tool-call tags among them are single tokens in a chat, never spelled out in pieces.
ADDED_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
ENDOFTEXT = 151_643
IM_START = 151_644
IM_END = 151_645
# A Qwen3 instruct model ends a turn with <|im_end|>, a base model with <|endoftext|>: either stops a call.
STOP_IDS = (ENDOFTEXT, IM_END)

QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@lru_cache(maxsize=2)
def qwen_tokenizer(path: str | None = None) -> tiktoken.Encoding:
    p = Path(path) if path else default_shared_dir() / "data/tokenizer/qwen.tiktoken"
    if not p.exists():
        raise FileNotFoundError(
            f"Qwen tokenizer not found at {p} (expected ../shared/data beside the project)"
        )
    return tiktoken.Encoding(
        "qwen", pat_str=QWEN_PATTERN, mergeable_ranks=load_tiktoken_bpe(str(p)), special_tokens={}
    )


@lru_cache(maxsize=1)
def chat_tokenizer() -> tiktoken.Encoding:
    """Qwen's tokenizer with its added tokens: what a chat template's text is encoded with."""
    base = qwen_tokenizer()
    return tiktoken.Encoding(
        "qwen-chat",
        pat_str=QWEN_PATTERN,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={t: ENDOFTEXT + i for i, t in enumerate(ADDED_TOKENS)},
    )


def count_tokens(text: str) -> int:
    return len(qwen_tokenizer().encode_ordinary(text))


def hf_tokenizer() -> Any:
    """Qwen's tokenizer as a transformers ``PreTrainedTokenizerFast`` (the same ids as ``chat_tokenizer``),
    built from the local BPE file, for libraries that take a tokenizer object (TRL's ``processing_class``):
    no hub download. ``<|im_end|>`` ends a turn; ``<|endoftext|>`` pads."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = default_shared_dir() / "data" / "tokenizer" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(
            f"Qwen tokenizer not found at {path} (expected ../shared/data beside the project)"
        )
    converted = TikTokenConverter(
        vocab_file=str(path), pattern=QWEN_PATTERN, extra_special_tokens=list(ADDED_TOKENS)
    ).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )

"""The Qwen tokenizer (byte-level BPE ranks shipped in ../shared/data/tokenizer), loaded offline with tiktoken.

Qwen2 and Qwen3 share these ordinary tokens; the pre-tokenisation pattern is Qwen's.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from loom.settings import default_shared_dir

# Qwen's special tokens follow its 151,643 ordinary ones: <|endoftext|>, <|im_start|>, <|im_end|>.
ENDOFTEXT = 151_643
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


def count_tokens(text: str) -> int:
    return len(qwen_tokenizer().encode_ordinary(text))

"""The wire protocol: every payload struct and subject name lives in this package."""

from loom.protocol import messages as _messages
from loom.protocol import subjects
from loom.protocol.codec import (
    INT_RANGE,
    DecodeError,
    decode,
    decode_union,
    encode,
    from_json,
    out_of_range,
    to_builtins,
    to_json,
)
from loom.protocol.messages import *  # noqa: F403

__all__ = [
    "INT_RANGE",
    "DecodeError",
    "decode",
    "decode_union",
    "encode",
    "from_json",
    "out_of_range",
    "subjects",
    "to_builtins",
    "to_json",
]
__all__ += [
    k for k, v in vars(_messages).items() if isinstance(v, type) and v.__module__ == _messages.__name__
]

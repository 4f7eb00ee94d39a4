"""msgpack/JSON codecs for the wire types. No pickle anywhere."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}
_json_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}

# msgspec.ValidationError subclasses DecodeError: one except clause catches malformed and invalid input.
DecodeError = msgspec.DecodeError


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes, typ: type[T]) -> T:
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    return dec.decode(data)


def decode_union(data: bytes, typ: Any) -> Any:
    """Decode into a union of tagged structs (``A | B``), which ``type[T]`` cannot express."""
    return decode(data, typ)


def to_json(obj: Any) -> bytes:
    return _json_encoder.encode(obj)


def from_json(data: bytes | str, typ: type[T], lax: bool = False) -> T:
    """``lax``: numbers as JSON Schema reads them (``3.0`` is an integer) and numeric strings, as a REST client
    generated from the OpenAPI document may send them; the bus stays strict."""
    dec = _json_decoders.get((typ, lax))
    if dec is None:
        dec = _json_decoders[(typ, lax)] = msgspec.json.Decoder(typ, strict=not lax)
    return dec.decode(data)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


# What msgpack, and so the bus, holds of an integer; JSON has them of any size.
INT_RANGE = "(-2**63 to 2**64 - 1)"


def out_of_range(obj: Any) -> list[str | int] | None:
    """Where in ``obj`` (a REST body as decoded) the first integer the bus cannot carry is, or None where it
    can go on the bus. Free-form fields (a task's data, a chat message) take any JSON number; a body holding
    a 36-digit one failed only when it was sent, as a 500. Encoded once; walked only where that fails."""
    try:
        _encoder.encode(obj)
    except OverflowError:
        return _first_out_of_range(msgspec.to_builtins(obj))
    return None


def _first_out_of_range(value: Any) -> list[str | int]:
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, v in items:
        if isinstance(v, int) and not -(2**63) <= v < 2**64:
            return [key]
        inner = _first_out_of_range(v)
        if inner:
            return [key, *inner]
    return []

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loom.protocol import (
    DecodeError,
    ErrorReply,
    GenAccepted,
    GenError,
    GenEvent,
    GenKeepalive,
    GenRequest,
    GenResult,
    JobSpec,
    Step,
    Trajectory,
    decode,
    decode_union,
    encode,
    from_json,
    out_of_range,
    subjects,
)
from loom.protocol.sessions import BadRequest, ChatRequest, read_request


def test_job_spec_defaults_and_strictness() -> None:
    spec = from_json(b'{"dataset": {"name": "swe-replay", "limit": 2}}', JobSpec)
    assert spec.group_size == 8 and spec.dataset is not None and spec.dataset.limit == 2
    with pytest.raises(DecodeError, match=r"\$\.group_size"):
        from_json(b'{"group_size": 0}', JobSpec)
    with pytest.raises(DecodeError, match="unknown field `colour`"):
        from_json(b'{"colour": "red"}', JobSpec)
    with pytest.raises(DecodeError, match=r"\$\.tasks\[0\]\.id"):
        from_json(b'{"tasks": [{"id": ""}]}', JobSpec)


@given(
    rid=st.text(min_size=1, max_size=40),
    n_in=st.integers(1, 1 << 20),
    n_out=st.integers(1, 1 << 16),
    prio=st.floats(allow_nan=False, allow_infinity=False),
)
def test_gen_request_roundtrip(rid: str, n_in: int, n_out: int, prio: float) -> None:
    req = GenRequest(rid, "job", "t", 0, n_in, n_out, priority=prio)
    assert decode(encode(req), GenRequest) == req


def test_gen_events_are_a_tagged_union_next_to_error_replies() -> None:
    events = [
        GenAccepted("r", "router"),
        GenKeepalive("r", "w0", "running"),
        GenResult("r", "w0", 5, "length"),
        GenError("r", "engine_error", "boom"),
        ErrorReply("bad_request", "nope"),
    ]
    for ev in events:
        assert decode_union(encode(ev), GenEvent | ErrorReply) == ev


def test_garbage_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode(b"\xc1\xc1", GenRequest)
    with pytest.raises(DecodeError):
        decode(encode({"rid": "x"}), GenRequest)


def test_trajectory_output_tokens_and_msgpack_size() -> None:
    steps = [Step(i, 1000 + i, 100, action="a" * 3000, observation="o" * 3000) for i in range(145)]
    t = Trajectory("j", "t", "task", 0, 0, "replay", "completed", "done", steps, 0.0, 1.0)
    assert t.output_tokens == 14500
    assert len(encode(t)) < 8 * 1024 * 1024  # the largest recorded trajectory fits one message
    assert msgspec.msgpack.decode(encode(t), type=Trajectory) == t


def test_subjects_are_versioned() -> None:
    assert subjects.worker_gen("w1") == "loom.v1.worker.w1.gen"
    assert subjects.results("job-1") == "loom.v1.results.job-1"
    assert all(s.startswith("loom.v1.") for s in subjects.STREAM_RESULTS_SUBJECTS)


# JSON values as a REST body decodes them: integers of any size among the rest.
_JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=3) | st.integers(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=20,
)


@given(_JSON)
def test_out_of_range_finds_what_the_bus_cannot_carry(value: object) -> None:
    """None exactly where msgpack encodes it; else the path to an integer outside 64 bits."""
    where = out_of_range(value)
    try:
        encode(value)
    except OverflowError:
        assert where is not None
        for key in where:
            value = value[key]  # type: ignore[index]
        assert isinstance(value, int) and not -(2**63) <= value < 2**64
    else:
        assert where is None


def test_an_openai_request_with_an_integer_the_bus_cannot_carry_is_a_bad_request() -> None:
    body = b'{"messages": [{"role": "user", "content": "hi", "n": ' + str(10**30).encode() + b"}]}"
    with pytest.raises(BadRequest, match=r"Integer out of range \(-2\*\*63 to 2\*\*64 - 1\)") as e:
        read_request(body, ChatRequest)
    assert e.value.param == "messages[0].n"
    ok = body.replace(str(10**30).encode(), str(2**64 - 1).encode())
    assert read_request(ok, ChatRequest).messages[0]["n"] == 2**64 - 1

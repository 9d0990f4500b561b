import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare import protocol as p
from tests.profiles import examples


def test_round_trip_every_field():
    m = p.Release(resident=5, swapped=7, again=True, swapped_out=3, seconds=0.5)
    frame = p.encode(m)
    assert p.frame_length(frame[:4]) == len(frame) - 4
    assert p.decode(frame[4:]) == m


def test_frame_buffer_splits_and_joins_frames():
    frames = p.encode(p.Acquire()) + p.encode(p.Grant(lease=3, swap_in=9, quantum_s=1.5))
    buf = p.FrameBuffer()
    got = []
    for i in range(len(frames)):  # one byte at a time
        got += buf.feed(frames[i : i + 1])
    assert got == [p.Acquire(), p.Grant(lease=3, swap_in=9, quantum_s=1.5)]


def test_oversized_frame_is_refused_before_reading():
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.frame_length((p.MAX_FRAME + 1).to_bytes(4, "big"))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        b"\x81\xa1t\xa5bogus",
        b"\x81\xa1t\xa7release",  # unknown tag, missing fields
        b"\x83\xa1t\xa7release\xa8resident\xa3abc\xa7swapped\x00",
    ],  # wrong type
)
def test_malformed_bodies_raise_protocol_error(body):
    with pytest.raises(p.ProtocolError, match="malformed"):
        p.decode(body)


@settings(max_examples=examples(10_000), deadline=None)
@given(st.binary(max_size=256))
def test_decoder_never_fails_other_than_protocol_error(data):
    with contextlib.suppress(p.ProtocolError):
        p.decode(data)


# Lies in well-formed messages: the codec carries them to the node exactly as sent (the
# node's checks see the lie, not a mangled value), and nothing the wire allows is lost.
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
anyfloat = st.floats(allow_nan=True, allow_infinity=True)
lies = st.one_of(
    st.builds(
        p.Hello, version=int64, name=st.text(max_size=300),
        memory_limit=st.one_of(st.none(), int64),
        weight=st.one_of(st.none(), anyfloat), portion=st.one_of(st.none(), anyfloat),
        resident=int64, swapped=int64, holding=st.booleans(), session=int64, lease=int64,
        token=st.text(max_size=80), gang_size=int64, rank=int64,
    ),
    st.builds(
        p.Release, resident=int64, swapped=int64, again=st.booleans(), swapped_out=int64,
        seconds=anyfloat, swapping_out=int64,
    ),
    st.builds(
        p.SwapDone, direction=st.sampled_from(["in", "out"]), bytes=int64, seconds=anyfloat,
        resident=int64, swapped=int64, error=st.text(max_size=50),
    ),
    st.builds(p.Report, resident=int64, swapped=int64),
)  # fmt: skip


@settings(max_examples=examples(2000), deadline=None)
@given(lies)
def test_lies_in_well_formed_messages_reach_the_node_as_sent(msg):
    frame = p.encode(msg)
    assert p.frame_length(frame[:4]) == len(frame) - 4
    back = p.decode(frame[4:])
    assert type(back) is type(msg) and p.encode(back) == frame  # NaN included, bit for bit


def test_a_name_too_long_for_one_frame_is_refused_before_it_is_sent():
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.encode(p.Hello(version=1, name="n" * (p.MAX_FRAME + 1)))

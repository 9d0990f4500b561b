import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare import protocol as p


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


@settings(max_examples=10_000, deadline=None)
@given(st.binary(max_size=256))
def test_decoder_never_fails_other_than_protocol_error(data):
    with contextlib.suppress(p.ProtocolError):
        p.decode(data)

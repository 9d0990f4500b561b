"""Request and limit end to end on the allocator library (issue 39): a node process,
a session whose memory goes through gpushare's allocator library on the fake libcuda
(as a torch-backend session's does on a GPU), with a request below its limit. It grows
past its request and is lent the bound, is held to its limit (the contract's
out-of-memory error), and its bytes come back intact after a swap out and in.

The node's GPU is simulated (its settings), the session's memory is the fake libcuda's:
the session is built with the library's backend directly, as ``attach`` builds it on a
real GPU."""

from __future__ import annotations

import pytest

import gpushare
from gpushare import protocol as p
from gpushare.client.session import Session
from gpushare.client.transport import UnixConnector, open_connection
from gpushare.errors import OutOfMemoryError
from tests.support import sim, wait_until

from .conftest import GRANULE, FakeGpu
from .test_vmm import fill, intact

PIECE = GRANULE


def library_session(node, gpu: FakeGpu, name: str, request: int, limit: int) -> Session:
    hello = p.Hello(
        version=p.PROTOCOL_VERSION,
        name=name,
        memory_limit=limit,
        memory_request=request,
        backend="torch",
        grows=True,
    )
    c = UnixConnector(node.socket)
    sock, welcome, rest = open_connection(c, hello, 10)
    return Session(
        sock,
        welcome,
        lambda hooks: gpu.backend(limit=limit, hooks=hooks),
        c.where,
        hello,
        connector=c,
        first=rest,
    )


def test_a_library_session_grows_to_its_bound_is_held_to_its_limit_and_swaps_intact(
    node_factory, gpu: FakeGpu
):
    node = node_factory(*sim(f"{16 * PIECE}", mode="auto", tq="0.3"))
    s = library_session(node, gpu, "lib", request=4 * PIECE, limit=8 * PIECE)
    with s.gpu():
        kept = fill(s.backend, [PIECE] * 4, seed=3)  # within its request
        kept += fill(s.backend, [PIECE] * 2, seed=4)  # past it: asks, lent the bound
        with pytest.raises(OutOfMemoryError, match="limit"):
            s.backend.allocate(3 * PIECE)  # past the limit (8 pieces): refused
        assert gpu.physical_bytes == 6 * PIECE  # nothing made for the refused one
    grants = [e for e in node.event_list() if e["event"] == "grant" and e["session"] == s.id]
    assert 6 * PIECE in [e.get("bound_bytes") for e in grants]  # the bound, not the limit
    grew = [e for e in node.event_list() if e["event"] == "release" and e["reason"] == "grow"]
    assert grew and all(e["session"] == s.id for e in grew)  # the allocation asked first
    # another session needs the room: the library session's memory leaves the GPU
    other = gpushare.attach(
        socket=node.socket, name="other", memory=12 * PIECE, backend="sim", timeout=10
    )
    with other.gpu():
        other.backend.allocate(12 * PIECE)
        assert gpu.mapped_bytes <= 4 * PIECE  # swapped out: at most 16 - 12 pieces stay
    other.close()
    with s.gpu():
        assert intact(kept)  # swapped in at the same addresses, every byte
    assert wait_until(lambda: gpu.mapped_bytes == 6 * PIECE, timeout=10, what="all back")
    s.close()

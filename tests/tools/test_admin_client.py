"""The admin client against a node that closes idle admin connections (issue 24)."""

from __future__ import annotations

import socket
import threading

from gpushare import protocol as p
from gpushare.status import NodeInfo, NodeStatus
from gpushare.tools.admin import AdminClient


def test_status_connects_again_after_the_node_closed_an_idle_connection(short_tmp):
    path = str(short_tmp / "a.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    answered = []

    def serve() -> None:
        for first in (True, False):  # the first connection is answered once, then closed
            c, _ = srv.accept()
            buf = p.FrameBuffer()
            while not buf.feed(c.recv(65536)):
                pass
            info = NodeInfo(pid=len(answered), started=0.0, config="")
            c.sendall(p.encode(p.StatusReply(status=NodeStatus(node=info, gpus=[]))))
            answered.append(first)
            if first:
                c.close()
            else:
                c.recv(1)
                c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with AdminClient(path, timeout=10) as c:
        assert c.status().node.pid == 0
        assert c.status().node.pid == 1  # on a new connection
    t.join(10)
    assert answered == [True, False]
    srv.close()

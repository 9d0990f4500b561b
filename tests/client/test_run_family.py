"""``gpushare run``: the processes a program starts join its session at their first GPU
work (docs/run.md, "Processes the program starts"): one lease, their memory out of the
session's limit. Real processes against a real node on a simulated GPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from gpushare import protocol as p
from tests.client.test_run import gs_run, lines
from tests.support import sim, wait_until

torch = pytest.importorskip(
    "torch",
    reason="PyTorch is not installed (make test installs the CPU build where its wheel is on disk)",
)

ENGINE = textwrap.dedent("""
    import json, multiprocessing as mp, os, sys, time, torch
    from gpushare.client import runner

    def engine(q):
        m = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8)
        m(x)  # its first GPU work: it joins here, and waits for the lease
        s = runner.SESSION
        q.put({"pid": os.getpid(), "session": s.id, "limit": s.memory_limit})
        for _ in range(20):
            m(x)
            time.sleep(0.01)  # a step's pace
        q.put({"grants": s.grants})

    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[1])
        q = ctx.Queue()
        child = ctx.Process(target=engine, args=(q,))
        child.start()
        first = q.get(timeout=120)
        head = runner.SESSION
        t = time.monotonic()
        while head.memory_limit == int(sys.argv[2]) and time.monotonic() - t < 10:
            time.sleep(0.01)  # told on its reader thread
        print(json.dumps({**first, "head": head.id, "head_limit": head.memory_limit}), flush=True)
        print(json.dumps(q.get(timeout=120)), flush=True)
        child.join()
        print(json.dumps({"exit": child.exitcode}), flush=True)
""")

GIB = 2**30


def _family(node: object) -> dict[str, dict]:
    return {str(s["id"]): s for s in node.status()["gpus"][0]["sessions"]}  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_an_engine_process_joins_the_session_and_waits_for_its_lease(
    node_factory, short_tmp, method
):
    # issue 28: vLLM's EngineCore and Worker ran the model ungated, the session idle
    node = node_factory(*sim("16GiB", mode="exclusive", tq="30"))
    prog = short_tmp / "engine.py"
    prog.write_text(ENGINE)
    import gpushare

    rival = gpushare.attach("4GiB", socket=node.socket, name="rival")
    with rival.gpu():  # the GPU is another's: the engine's forward must wait for it
        pr = gs_run(
            node,
            "--memory",
            "8GiB",
            "--",
            sys.executable,
            str(prog),
            method,
            str(8 * GIB),
            extra_env={"GPUSHARE_MEMBER_MEMORY": "3GiB"},
        )

        def member_waits():
            return [
                s
                for s in _family(node).values()
                if s["family"] and s["state"] == "waiting" and s["gang"].startswith("session:")
            ]

        (member,) = wait_until(member_waits, 120, "the engine process to wait for the lease")
        head = _family(node)[str(member["family"])]
        assert head["state"] == "idle" and head["gang"] == member["gang"]
        assert member["memory_limit_bytes"] == 3 * GIB
        assert head["memory_limit_bytes"] == 5 * GIB  # the 8 GiB split, no more counted
        table = node.ctl("status").stdout
        assert f"family of session {head['id']}: sessions {head['id']}, {member['id']}" in table
    rival.close()
    out, err = pr.communicate(timeout=180)
    assert pr.returncode == 0, err
    first, done, end = lines(out)
    assert first["session"] == member["id"] and first["head"] == head["id"]
    assert (first["limit"], first["head_limit"]) == (3 * GIB, 5 * GIB)
    assert done["grants"] >= 1 and end["exit"] == 0
    said = [x for x in err.splitlines() if f"joined session {head['id']}" in x]
    assert len(said) == 1 and f"process {first['pid']}" in said[0], err
    # it left: what it took is the session's again (the session has gone too by now)
    assert wait_until(lambda: str(member["id"]) not in _family(node), 30, "the member to detach")


def test_a_process_not_started_by_the_session_cannot_join_it(node_factory):
    # the node believes the kernel's process tree, not the hello: a process of the same
    # user that the session did not start (here its parent) is refused, and the session
    # keeps its limit
    node = node_factory(*sim("16GiB"))
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import gpushare, sys, time\n"
            f"s = gpushare.attach('8GiB', socket={node.socket!r}, name='server')\n"
            "print(s.id, flush=True)\n"
            "sys.stdin.read()\n"
            "print(s.memory_limit, flush=True)\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    sid = int(server.stdout.readline())
    c = socket.socket(socket.AF_UNIX)
    c.connect(node.socket)
    c.sendall(p.encode(p.Hello(version=p.PROTOCOL_VERSION, name="intruder", family=sid)))
    buf, msgs = p.FrameBuffer(), []
    while not msgs:
        msgs = buf.feed(c.recv(65536))
    c.close()
    (err,) = msgs
    assert isinstance(err, p.Error) and err.code == "family", err
    assert f"was not started by session {sid}'s process" in err.message
    assert _family(node)[str(sid)]["memory_limit_bytes"] == 8 * GIB
    out, _ = server.communicate("", timeout=60)
    assert int(out) == 8 * GIB  # never told of another limit


def test_a_child_of_the_session_joins_through_the_protocol(node_factory):
    # the same check passes for a real child: this process's own fork
    node = node_factory(*sim("16GiB"))
    import gpushare

    s = gpushare.attach("8GiB", socket=node.socket, name="server")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a hello with family over a fresh connection
        try:
            c = socket.socket(socket.AF_UNIX)
            c.connect(node.socket)
            c.sendall(p.encode(p.Hello(version=p.PROTOCOL_VERSION, family=s.id)))
            buf = p.FrameBuffer()
            msgs: list[p.Message] = []
            while not msgs:
                msgs = buf.feed(c.recv(65536))
            m = msgs[0]
            os.write(w, json.dumps([type(m).__name__, getattr(m, "memory_limit", 0)]).encode())
        finally:
            os._exit(0)
    os.close(w)
    got = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    assert got == ["Welcome", 8 * GIB]  # all the session had free
    wait_until(
        lambda: _family(node)[str(s.id)]["memory_limit_bytes"] == 8 * GIB, 10, "its limit back"
    )


SERVER = textwrap.dedent("""
    import json, multiprocessing as mp, os, sys, time, torch

    def engine(q, out):
        m = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8)
        m(x)  # its start: it joins the session here
        out.put("ready")
        while (sent := q.get()) is not None:  # a request: a few forwards, then idle
            for _ in range(3):
                m(x)
            out.put(time.monotonic() - sent)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")  # as vLLM starts its EngineCore and Worker
        q, out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=engine, args=(q, out))
        child.start()
        assert out.get(timeout=120) == "ready"
        print(json.dumps({"ready": True}), flush=True)
        while not os.path.exists(sys.argv[1]):
            time.sleep(0.01)
        waits = []
        for _ in range(int(sys.argv[2])):
            time.sleep(1.0)  # requests a second apart
            q.put(time.monotonic())
            waits.append(out.get(timeout=120))
        q.put(None)
        child.join()
        print(json.dumps({"waits": waits, "exit": child.exitcode}), flush=True)
""")


def test_a_server_of_several_processes_answers_beside_a_trainer_in_turns(node_factory, short_tmp):
    """Issue 40, vLLM's process shape: the API server under ``gpushare run`` starts its
    engine process (spawn), which joins the session and does the model's work; a trainer
    holds the GPU at TQ 30. The family counted as a gang, and gangs took no turns: each
    request waited the trainer's whole quantum (vLLM's CPU build: 8.8-9.1 s at TQ 10).
    Each request is a turn now, answered in a fraction of the quantum."""
    import gpushare

    node = node_factory(*sim("16GiB", mode="exclusive", tq="30"))
    prog, go = short_tmp / "server.py", short_tmp / "go"
    prog.write_text(SERVER)
    pr = gs_run(node, "--memory", "8GiB", "--", sys.executable, str(prog), str(go), "5",
                extra_env={"GPUSHARE_MEMBER_MEMORY": "3GiB"})  # fmt: skip
    assert pr.stdout is not None
    assert json.loads(pr.stdout.readline()) == {"ready": True}, pr.stderr
    trainer = gpushare.attach("6GiB", socket=node.socket, name="trainer")
    stop = threading.Event()

    def train() -> None:
        with trainer.gpu():  # one long burst, a safe point every 5 ms
            while not stop.is_set():
                time.sleep(0.005)
                trainer.checkpoint()

    t = threading.Thread(target=train)
    t.start()
    wait_until(lambda: trainer.holding, 60, "the trainer to hold the GPU")
    go.touch()
    try:
        out, err = pr.communicate(timeout=240)
    finally:
        stop.set()
        t.join(timeout=60)
        trainer.close()
    assert pr.returncode == 0, err
    (done,) = lines(out)
    assert done["exit"] == 0 and len(done["waits"]) == 5
    assert max(done["waits"]) < 10.0, done  # turns, not the trainer's 30 s quantum

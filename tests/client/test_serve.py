"""A server under ``gpushare run`` (issue 28): a plain asyncio HTTP server whose /predict
runs a model, gated, and whose /health does not. Waiting for the lease off the loop
leaves /health answering; waiting on the loop's thread is said once, with the fix; a
session ended by an administrator stops the server without an HTTP 500 or a traceback
through gpushare's hooks."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import textwrap

import pytest

import gpushare
from tests.support import sim, wait_until

from .test_run import gs_run

pytest.importorskip("torch", reason="PyTorch is not installed")

SERVER = textwrap.dedent("""
    import asyncio, signal, sys, traceback, torch
    model = torch.nn.Linear(4, 4)
    OFF_LOOP = sys.argv[1] == "thread"  # else the model runs on the loop (an async endpoint)

    def predict():
        with torch.no_grad():
            return float(model(torch.ones(1, 4)).sum())

    inflight = set()

    async def handle(reader, writer):
        inflight.add(asyncio.current_task())
        try:
            words = (await reader.readline()).split()
            if len(words) < 2:  # a probe that connects and closes (the test's `listening`)
                writer.close()
                return
            path = words[1]
            while (await reader.readline()) not in (b"\\r\\n", b""):
                pass
            status, body = 200, "ok"
            if path == b"/predict":
                try:
                    y = await asyncio.to_thread(predict) if OFF_LOOP else predict()
                    body = f"{y:.4f}"
                except Exception:  # as a framework does: logged, and answered 500
                    traceback.print_exc()
                    status, body = 500, "error"
            writer.write(f"HTTP/1.1 {status} X\\r\\nContent-Length: {len(body)}\\r\\n"
                         f"Connection: close\\r\\n\\r\\n{body}".encode())
            await writer.drain()
            writer.close()
        finally:
            inflight.discard(asyncio.current_task())

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        server.close()  # a graceful shutdown, as uvicorn's: the requests in flight first
        while inflight:
            await asyncio.sleep(0.05)  # a look every 50 ms till the last is answered

    asyncio.run(main())
""")


def ask(port: int, path: str) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port), timeout=60)
    c.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return c


def answer(c: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := c.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    c.close()
    return data


def readable(c: socket.socket) -> bool:
    # poll, not select: late in an xdist worker the fd may be above FD_SETSIZE (1024)
    p = select.poll()
    p.register(c, select.POLLIN)
    return bool(p.poll(0))


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def waiting(node, name: str) -> dict | None:
    return next(
        (
            s
            for s in node.status()["gpus"][0]["sessions"]
            if s["name"] == name and s["state"] == "waiting"
        ),
        None,
    )


def serve(node, mode: str) -> tuple[subprocess.Popen[str], int]:
    pr = gs_run(
        node, "--memory", "1GiB", "--name", "server", "--", sys.executable, "-c", SERVER, mode
    )
    assert pr.stdout is not None
    line = pr.stdout.readline()
    assert line.strip().isdigit(), line
    return pr, int(line)


def test_health_answers_while_a_request_waits_for_the_lease(node_factory):
    node = node_factory(*sim("16GiB", mode="exclusive"))
    pr, port = serve(node, "thread")
    try:
        with gpushare.attach("1GiB", socket=node.socket, name="holder") as holder:
            with holder.gpu():
                predict = ask(port, "/predict")
                wait_until(lambda: waiting(node, "server"), timeout=30, what="/predict to wait")
                assert answer(ask(port, "/health")).endswith(b"\r\n\r\nok")
                assert not readable(predict)  # still waiting
            assert answer(predict).startswith(b"HTTP/1.1 200")
    finally:
        pr.terminate()
        _, err = pr.communicate(timeout=30)
    assert "asyncio event loop" not in err and "Traceback" not in err, err


def test_a_wait_on_the_loops_thread_is_said_once_with_the_fix(node_factory):
    # the loop answers nothing while it waits: nothing can move that wait off the loop
    # from inside the synchronous call, so the program is told how to do it
    node = node_factory(*sim("16GiB", mode="exclusive"))
    pr, port = serve(node, "loop")
    try:
        with gpushare.attach("1GiB", socket=node.socket, name="holder") as holder:
            with holder.gpu():
                predict = ask(port, "/predict")
                wait_until(lambda: waiting(node, "server"), timeout=30, what="/predict to wait")
            assert answer(predict).startswith(b"HTTP/1.1 200")
            with holder.gpu():
                predict = ask(port, "/predict")
                wait_until(lambda: waiting(node, "server"), timeout=30, what="/predict to wait")
            assert answer(predict).startswith(b"HTTP/1.1 200")
    finally:
        pr.terminate()
        _, err = pr.communicate(timeout=30)
    said = [x for x in err.splitlines() if "asyncio event loop" in x]
    assert len(said) == 1 and "asyncio.to_thread" in said[0], err


def test_a_server_ended_while_a_request_waits_stops_without_a_500_or_a_traceback(
    node_factory,
):
    # issue 28: the waiting request was answered HTTP 500, with a traceback through the
    # hooks, while the server shut down on the SIGTERM: now the request stays waiting
    # until the program is stopped (its graceful shutdown waits for it: SIGKILL at 10 s)
    node = node_factory(*sim("16GiB", mode="exclusive"))
    pr, port = serve(node, "thread")
    try:
        with gpushare.attach("1GiB", socket=node.socket, name="holder") as holder, holder.gpu():
            predict = ask(port, "/predict")
            s = wait_until(lambda: waiting(node, "server"), timeout=30, what="a wait")
            assert node.ctl("end", str(s["id"]), "--grace", "0").returncode == 0
            got = answer(predict)
            _, err = pr.communicate(timeout=60)
    finally:
        pr.kill()
    assert b"500" not in got and "Traceback" not in err, (got, err)
    ours = [x for x in err.splitlines() if x.startswith("gpushare")]
    assert len(ours) == 2 and ours[1] == (
        "gpushare run: error: session ended: ended by an administrator: stopping the program"
        " (SIGTERM, SIGKILL after 10 s)"
    ), err
    assert pr.returncode != 0


def test_a_server_ended_with_a_grace_answers_the_request_in_flight_then_stops(node_factory):
    # issue 40: `ctl end` drains. The server is told (SIGTERM) at once and keeps its
    # turns for the grace: its shutdown answers the request that waited, then it exits
    # by itself, well before the grace is over; the node counts the session ended.
    node = node_factory(*sim("16GiB", mode="exclusive"))
    pr, port = serve(node, "thread")
    try:
        with gpushare.attach("1GiB", socket=node.socket, name="holder") as holder:
            with holder.gpu():
                predict = ask(port, "/predict")
                s = wait_until(lambda: waiting(node, "server"), timeout=30, what="a wait")
                done = node.ctl("end", str(s["id"]), "--grace", "5m")
                assert "keeps its turns for 300 s" in done.stdout, done.stdout
                # told, the program shuts down (it listens no more); its request waits on
                wait_until(lambda: not listening(port), timeout=30, what="its shutdown")
                assert not readable(predict)
            got = answer(predict)  # the holder gave the GPU back: the server's turn
            _, err = pr.communicate(timeout=60)
    finally:
        pr.kill()
    assert got.startswith(b"HTTP/1.1 200") and b"Traceback" not in got, got
    assert pr.returncode == 0, err  # it ended by itself, not killed
    assert "Traceback" not in err, err
    assert (
        "gpushare run: error: ended by an administrator: stopping the program (SIGTERM;"
        " the node ends the session in 300 s, SIGKILL then)"
    ) in err, err
    events = [json.loads(x) for x in node.ctl("events").stdout.splitlines()]
    detach = [e for e in events if e["event"] == "detach" and e["session"] == s["id"]]
    assert [e["reason"] for e in detach] == ["ended"], detach


def test_a_program_that_outstays_its_grace_is_ended_and_killed(node_factory):
    # one that ignores the SIGTERM: the node ends its session at the grace's end, its
    # memory freed, and `gpushare run` kills it then, not ten seconds later
    node = node_factory(*sim("16GiB", mode="exclusive"))
    stubborn = (
        "import signal, time, gpushare\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "while True:\n"
        "    time.sleep(0.05)\n"
    )
    pr = gs_run(
        node, "--memory", "1GiB", "--name", "stubborn", "--", sys.executable, "-c", stubborn
    )
    try:
        assert pr.stdout is not None and pr.stdout.readline().strip() == "up"
        s = wait_until(
            lambda: next((x for x in node.status()["gpus"][0]["sessions"]), None),
            timeout=30,
            what="the session",
        )
        node.ctl("end", str(s["id"]), "--grace", "1s")
        _, err = pr.communicate(timeout=60)
    finally:
        pr.kill()
    assert pr.returncode == -9, err
    assert "its grace is over: SIGKILL" in err, err
    assert node.status()["gpus"][0]["sessions"] == []


@pytest.mark.parametrize("grace", ["-1", "nan", "2h"])
def test_a_grace_out_of_range_is_refused_in_one_line(node_factory, grace):
    node = node_factory(*sim("16GiB"))
    r = node.ctl("end", "1", "--grace", grace, check=False)
    assert r.returncode == 2 and "--grace" in r.stderr and "Traceback" not in r.stderr, r.stderr

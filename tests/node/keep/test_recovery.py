"""The node believes only what it can check (issue 11), with real processes: a node
SIGKILLed again and again under oversubscribed load keeps every invariant in every
status poll and loses no byte; a process is matched to its record by what the kernel
says, not by the id it names; signals reach every process holding a session's connection
and no other (another uid's, a pid taken since); files are never reached through a
symlink nor truncated under a workload that maps them; administration comes only from
the host or the node's own pod."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import gpushare
from gpushare.errors import GpushareError
from gpushare.node.host.procs import ProcRef, holders_of, peer_inode, pidfd_signal, ref_of
from gpushare.node.keep.recovery import JOURNAL_FILE, LEASE_BLOCK, Recovery, SessionRecord
from gpushare.node.keep.safefs import SafeDir
from gpushare.tools.admin import AdminClient
from tests.support import sim, wait_until

G = 2**30


def events(node, kind: str) -> list[dict]:
    return [e for e in node.event_list() if e["event"] == kind]


class Poller(threading.Thread):
    """Polls the node's status as fast as it answers; every poll must show the
    invariants (one exclusive holder at most, no more memory in use than usable)."""

    def __init__(self, admin: str) -> None:
        super().__init__(daemon=True)
        self.admin, self.polls, self.bad = admin, 0, []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with AdminClient(self.admin, timeout=2) as c:
                    st = c.status()
            except (GpushareError, OSError):
                time.sleep(0.01)  # the node is away
                continue
            self.polls += 1
            for g in st.gpus:
                if g.mode == "exclusive" and len(g.holders) > 1:
                    self.bad.append(f"two exclusive holders: {g.holders}")
                if g.used_bytes > g.usable_bytes:
                    self.bad.append(f"used {g.used_bytes} > usable {g.usable_bytes}")


@pytest.mark.slow
def test_a_node_killed_again_and_again_under_oversubscribed_load_keeps_every_invariant(
    node_factory,
):
    node = node_factory(*sim("80GiB", mode="exclusive", tq="0.5"))
    env = {**os.environ, "GPUSHARE_RECONNECT_TIMEOUT": "60"}
    # they run until told to stop (SIGTERM): not for a fixed time, which a loaded
    # machine may spend on the restarts alone, leaving one of them no turn
    procs = [
        node.workload("batch", "--memory", "30GiB", "--seconds", "600", "--seed", str(i),
                      "--name", f"w{i}", env=env)
        for i in range(4)
    ]  # fmt: skip
    wait_until(lambda: len(node.status()["gpus"][0]["sessions"]) == 4, timeout=30, what="4")
    poller = Poller(node.admin)
    poller.start()
    try:
        for restarts, away in enumerate((0.2, 0.5, 0.1, 0.3)):
            # killed under load: once it has recovered from the last kill and granted
            # again since (not at a fixed time, which a loaded machine may not have reached)
            wait_until(lambda n=restarts: granting_since_recovery(node, n), timeout=60,
                       what=f"grants after recovery {restarts}")  # fmt: skip
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()
            time.sleep(away)  # the node away this long: the workloads go on (or wait)
            node.start()
        # every workload has had two turns since the last recovery: the first of them
        # came after others ran, so it checked its bytes
        wait_until(lambda: turns_since_recovery(node, 4) >= {1, 2, 3, 4}, timeout=120,
                   what="two turns each after the last recovery")  # fmt: skip
        for pr in procs:
            pr.send_signal(signal.SIGTERM)
        outs = [pr.communicate(timeout=120) for pr in procs]
    finally:
        poller.stop.set()
        poller.join(10)
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    # no workload died of a signal (SIGBUS from a truncated link file, say), each ended well
    assert [pr.returncode for pr in procs] == [0] * 4, [
        err[-1500:] for (_, err), pr in zip(outs, procs, strict=True) if pr.returncode
    ]  # the stderr of those that failed
    figures = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(f["failures"] == 0 and f["checks"] >= 1 for f in figures), figures
    assert poller.polls > 50 and poller.bad == [], poller.bad[:5]
    recovered = [e for e in events(node, "recovery") if e["phase"] == "end"]
    assert len(recovered) == 4 and all(e["missing"] == 0 for e in recovered), recovered
    # every workload kept its id through every restart
    assert sorted(f["session"] for f in figures) == [1, 2, 3, 4]


def turns_since_recovery(node, restarts: int) -> set[int]:
    """The sessions granted at least twice since the ``restarts``-th recovery ended."""
    evs = node.event_list()
    ends = [i for i, e in enumerate(evs) if e["event"] == "recovery" and e["phase"] == "end"]
    if len(ends) < restarts:
        return set()
    grants = [e["session"] for e in evs[ends[restarts - 1] + 1 :] if e["event"] == "grant"]
    return {sid for sid in grants if grants.count(sid) >= 2}


def granting_since_recovery(node, restarts: int) -> bool:
    """The node has ended ``restarts`` recoveries and granted twice since the last."""
    evs = node.event_list()
    ends = [i for i, e in enumerate(evs) if e["event"] == "recovery" and e["phase"] == "end"]
    if len(ends) < restarts:
        return False
    since = evs[ends[-1] + 1 :] if ends else evs
    return sum(e["event"] == "grant" for e in since) >= 2


REGISTER = """
import socket, sys, time
from gpushare import protocol as p
t = time.monotonic()
while True:  # 'busy' (the recovery window open), as the client does: again
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    hello = p.Hello(version=1, name="x", memory_limit=2**30, session=int(sys.argv[2]))
    s.sendall(p.encode(hello))
    buf = p.FrameBuffer()
    while not (m := buf.feed(s.recv(65536))):
        pass
    if not (isinstance(m[0], p.Error) and m[0].code == "busy") or time.monotonic() - t > 30:
        break
    s.close()
    time.sleep(0.2)  # the client's retry interval while the node says 'busy'
print(m[0].session if isinstance(m[0], p.Welcome) else m[0], flush=True)
sys.stdin.read()
"""


def test_a_process_gets_back_only_its_own_sessions_id(node_factory):
    node = node_factory(*sim("16GiB"))
    keeper = subprocess.Popen(
        [sys.executable, "-c", REGISTER, node.socket, "0"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert keeper.stdout is not None
        sid = int(keeper.stdout.readline())
        state = Path(node.admin).parent / "sessions.state"
        wait_until(  # written within 0.1 s: killed before, nothing would be on record
            lambda: state.exists() and str(keeper.pid) in state.read_text(errors="replace"),
            timeout=30,
            what="the keeper's session on record",
        )
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node.start()  # the keeper's session is on record, its process alive
        thief = subprocess.run(
            [sys.executable, "-c", REGISTER, node.socket, str(sid)],
            input="", capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        got = int(thief.stdout)  # after the window: the keeper never said hello again
        assert got != sid and got > sid  # a new id: it is not the process on record
    finally:
        keeper.kill()
        keeper.wait()


# --- signals ----------------------------------------------------------------------------


def _sleeper() -> subprocess.Popen[bytes]:
    # a process that only lives (60 s at most): the target of the signals under test
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_signal_never_reaches_a_process_that_took_the_pid_since():
    victim = _sleeper()
    try:
        ref = ref_of(victim.pid)
        assert ref is not None
        # What a pid reused after the session's process ended looks like: the same pid,
        # another start time. The pidfd is opened, the start time checked: not sent.
        reused = ProcRef(ref.pid, ref.start_time - 1, ref.uid)
        assert not pidfd_signal(reused, signal.SIGKILL)
        assert not pidfd_signal(ProcRef(ref.pid, ref.start_time, ref.uid + 1), signal.SIGKILL)
        assert not pidfd_signal(ProcRef(os.getpid(), 0, os.getuid()), signal.SIGKILL)
        assert not pidfd_signal(ProcRef(1, 0, 0), signal.SIGKILL)
        time.sleep(0.2)  # a quiet period: a signal sent by mistake would have landed
        assert victim.poll() is None
        assert pidfd_signal(ref, signal.SIGKILL)  # the process itself: sent
        assert victim.wait(timeout=10) == -signal.SIGKILL
        assert not pidfd_signal(ref, signal.SIGKILL)  # gone
    finally:
        if victim.poll() is None:
            victim.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a process of another uid")
def test_the_holders_of_a_connection_are_its_uids_processes_that_have_it_open():
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        assert peer_inode(a) == os.fstat(b.fileno()).st_ino
        r, w = os.pipe()
        ready_r, ready_w = os.pipe()
        kids = []
        for uid in (os.getuid(), 65534):
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the children keep b open, one as nobody
                if uid != os.getuid():
                    os.setuid(uid)
                os.write(ready_w, b"x")  # looked at only once it is who it will be
                os.read(r, 1)
                os._exit(0)
            kids.append(pid)
        for _ in kids:  # on a loaded machine the fork returns before the child's setuid
            assert os.read(ready_r, 1) == b"x"
        os.close(ready_r)
        os.close(ready_w)
        found = {x.pid for x in holders_of(peer_inode(a), os.getuid())}
        assert os.getpid() in found and kids[0] in found and kids[1] not in found
        os.write(w, b"xx")
        for pid in kids:
            os.waitpid(pid, 0)
    finally:
        a.close()
        b.close()


FORKER = """
import os, sys, time, gpushare
s = gpushare.attach("1GiB", socket=sys.argv[1], name="forker")
with s.gpu():
    child = os.fork()  # a DataLoader worker: it inherits the session's socket
    if child == 0:
        time.sleep(120)  # a worker that only holds the socket
        os._exit(0)
    if len(sys.argv) > 2:  # and one that runs as another user, holding it too
        other = os.fork()
        if other == 0:
            os.setuid(65534)
            time.sleep(120)  # holds it too, as another user
            os._exit(0)
        print(child, other, flush=True)
    else:
        print(child, flush=True)
    time.sleep(120)  # GPU work with no safe point: it never yields
"""


def test_the_kill_escalation_reaches_a_forked_child_and_no_other_uid(node_factory):
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.3", grace="0.3", escalation="kill"))
    other_uid = os.geteuid() == 0
    pr = subprocess.Popen(
        [sys.executable, "-c", FORKER, node.socket, *(["other"] if other_uid else [])],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert pr.stdout is not None
    kids = [int(x) for x in pr.stdout.readline().split()]
    try:
        with gpushare.attach("1GiB", socket=node.socket, name="patient") as s, s.gpu():
            assert s.holding  # granted once the whole stuck workload is gone
        assert pr.wait(timeout=10) == -signal.SIGKILL
        wait_until(lambda: not Path(f"/proc/{kids[0]}").exists() or _zombie(kids[0]),
                   what="the forked child killed too")  # fmt: skip
        if other_uid:
            assert Path(f"/proc/{kids[1]}").exists() and not _zombie(kids[1])
    finally:
        for k in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(k, signal.SIGKILL)
        if pr.poll() is None:
            pr.kill()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


# --- files ---------------------------------------------------------------------------------


def test_the_link_file_is_kept_across_restarts_and_never_reached_through_a_symlink(
    node_factory, short_tmp
):
    victim = short_tmp / "victim"
    victim.write_bytes(b"precious" * 100)
    os.chmod(victim, 0o644)
    name = f"w.sock.u{os.geteuid()}.link0"
    os.symlink(victim, short_tmp / name)  # planted where the node makes its link file
    os.symlink(victim, short_tmp / "sessions.state")  # and its session records
    node = node_factory(*sim("16GiB"))
    with gpushare.attach("1GiB", socket=node.socket) as s:
        assert os.readlink(f"/proc/self/fd/{s.backend.link._fd}") == str(short_tmp / name)
    st = os.lstat(short_tmp / name)
    assert st.st_mode & 0o777 == 0o600 and not os.path.islink(short_tmp / name)
    assert victim.read_bytes() == b"precious" * 100 and victim.stat().st_mode & 0o777 == 0o644
    assert not os.path.islink(short_tmp / "sessions.state")
    # a workload maps it across a node restart: the file is the same, never truncated
    with gpushare.attach("1GiB", socket=node.socket) as s, s.gpu():
        m = s.backend.allocate(G // 4)
        m.fill(3)
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node.start()
        assert os.stat(short_tmp / name).st_ino == st.st_ino
        assert os.stat(short_tmp / name).st_size == st.st_size
        s.backend.link.book(0, 1, 1e9)  # still mapped, still whole (no SIGBUS)
        assert m.verify(3)


def test_a_socket_directory_others_may_write_is_refused(short_tmp):
    d = short_tmp / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    r = subprocess.run(
        [sys.executable, "-m", "gpushare", "node", *sim("16GiB"), "--socket", str(d / "w.sock"),
         "--admin-socket", str(short_tmp / "a.sock"), "--metrics-port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode != 0 and "others may write in it" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_simulated_link_of_another_size_is_a_clear_error(short_tmp):
    from gpushare.simlink import MAX_LEAD_S, SimLink

    empty = short_tmp / "empty"
    empty.write_bytes(b"")
    with pytest.raises(OSError, match="has 0 bytes"):  # not a bare ValueError from mmap
        SimLink(str(empty))
    # garbage booked far ahead (a hostile writer) stalls no one for long
    SimLink.create(str(short_tmp / "link"))
    link = SimLink(str(short_tmp / "link"))
    import struct

    for far in (float("inf"), float("nan"), time.monotonic() + 1e9):
        struct.pack_into("=dd", link._mem, 0, far, far)
        assert link.book(0, 1000, 1e9) < time.monotonic() + MAX_LEAD_S
    link.close()


# --- administration --------------------------------------------------------------------------

ADMIN = """
import sys
from gpushare.tools.admin import AdminClient
sys.stdin.readline()  # placed first (its cgroup written in the node's /proc root)
try:
    with AdminClient(sys.argv[1]) as c:
        c.status()
    print("ok", flush=True)
except Exception as e:
    print(e, flush=True)
"""


def _admin_from(node, proc_root: Path, cgroup: str) -> str:
    pr = subprocess.Popen(
        [sys.executable, "-c", ADMIN, node.admin],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    d = proc_root / str(pr.pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    out, _ = pr.communicate("go\n", timeout=30)
    return out.strip()


def test_administration_only_from_the_host_or_the_nodes_own_pod(node_factory, short_tmp):
    proc = short_tmp / "proc"
    node = node_factory(*sim("16GiB"), "--proc-root", str(proc), start=False)
    node.start()
    assert node.proc is not None
    own = "0::/kubepods.slice/kubepods-burstable-pod11111111_2222_3333_4444_555555555555.slice/"
    (proc / str(node.proc.pid)).mkdir(parents=True)
    (proc / str(node.proc.pid) / "cgroup").write_text(
        own + "cri-containerd-" + "a" * 64 + ".scope\n"
    )
    other = own.replace("11111111", "99999999")
    assert _admin_from(node, proc, "0::/user.slice/session-1.scope\n") == "ok"  # the host
    assert _admin_from(node, proc, own + "cri-containerd-" + "b" * 64 + ".scope\n") == "ok"
    denied = _admin_from(node, proc, other + "cri-containerd-" + "c" * 64 + ".scope\n")
    assert "administered only from the host or its own pod" in denied  # root, elsewhere
    assert events(node, "refused")[-1]["code"] == "denied"


FAST = """
import sys, gpushare
s = gpushare.attach(memory="1GiB", socket=sys.argv[1], name="fast", timeout=30)
for _ in range(int(sys.argv[2])):
    with s.gpu():
        pass
print("done", flush=True)
"""


def test_an_honest_fast_client_is_slowed_down_not_ended(node_factory):
    # Issue 24: a loop of empty `with s.gpu():` blocks was ended in 4 of 5 runs ("more
    # than 2000 messages per second: slow down"). Over the rate it is read later.
    node = node_factory(*sim("16GiB"), start=False)
    conf = node.dir / "node.toml"
    conf.write_text("max_messages_per_s = 100\n")
    node.args += ["--config", str(conf)]
    node.start()
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", FAST, node.socket, "300"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-800:]
    assert took >= (600 - 200) / 100 * 0.9  # 600 messages or more, at 100 a second
    assert not events(node, "refused")


# --- the lease journal: a grant on disk before its holder hears of it ---------------------


def _records(tmp_path: Path, live: list) -> Recovery:
    r = Recovery(SafeDir(tmp_path), 1, lambda: list(live), lambda: "/proc")
    r.load()
    return r


def _me(sid: int, lease: int = 0) -> SessionRecord:
    me = ref_of(os.getpid(), "/proc")
    assert me is not None
    return SessionRecord(id=sid, gpu=0, pid=me.pid, start_time=me.start_time, uid=me.uid,
                         limit=G, name=f"s{sid}", lease=lease)  # fmt: skip


def test_a_grant_is_a_journal_line_not_a_whole_write_and_is_read_back(tmp_path, monkeypatch):
    r = _records(tmp_path, [_me(1, lease=1), _me(2)])  # as the node sees them
    r.granted(0, 1, 1)  # the first lease moves the floor: a whole write
    writes: list[str] = []
    real = r.dir.write

    def write(name: str, *args, **kw) -> None:
        writes.append(name)
        real(name, *args, **kw)

    monkeypatch.setattr(r.dir, "write", write)
    r.granted(0, 2, 2)
    r.granted(0, 1, 3)
    assert writes == []  # the hot path: an append, no flushed rename
    # killed here: the next node reads the records and the journal's grants after them
    back = {x.id: x for x in _records(tmp_path, []).previous.values()}
    assert (back[1].lease, back[2].lease) == (3, 2)


def test_a_journal_line_a_later_whole_write_holds_is_never_read_back_over_it(tmp_path):
    live = [_me(1)]
    r = _records(tmp_path, live)
    r.granted(0, 1, 1)
    r.granted(0, 1, 2)  # journalled
    journal = (tmp_path / JOURNAL_FILE).read_bytes()
    assert journal
    assert r.save()  # session 1 released lease 2 since: on record as holding none
    assert (tmp_path / JOURNAL_FILE).read_bytes() == b""  # emptied
    # A node killed between the rename and the emptying left the old lines: skipped
    (tmp_path / JOURNAL_FILE).write_bytes(journal)
    assert _records(tmp_path, []).previous[1].lease == 0  # released stays released


def test_a_torn_journal_line_is_cut_off_and_never_read_as_a_grant(tmp_path):
    # Seen (a review): a line cut inside its lease's digits ("... 1 10400" as "... 1 10")
    # still parsed, as lease 10, which had been released and written whole: given back.
    live = [_me(1), _me(2)]
    r = _records(tmp_path, live)
    r.granted(0, 1, 1)
    r.granted(0, 1, 10)
    assert r.save()  # lease 10 released since: on record as holding none
    gen = r.generation
    with open(tmp_path / JOURNAL_FILE, "ab") as f:
        f.write(f"{gen} 0 2 7\n{gen} 0 1 10400".encode()[:-3])  # killed writing it
    r2 = _records(tmp_path, live)
    assert (r2.previous[1].lease, r2.previous[2].lease) == (0, 7)
    r2.granted(0, 1, 11)  # the next node's first grant: a line of its own
    with open(tmp_path / JOURNAL_FILE, "ab") as f:  # lines no grant wrote
        f.write(f"{gen} 5 2 4\n{gen - 1} 0 2 3\nnonsense\n".encode())
    back = _records(tmp_path, []).previous
    assert (back[1].lease, back[2].lease) == (11, 7)


def test_a_short_journal_write_is_cut_back_and_the_records_written_whole(tmp_path, monkeypatch):
    # Seen (a review): a short write (a full disk) went unnoticed: the grant taken for on
    # disk, and a torn line left for the next one to join.
    r = _records(tmp_path, [_me(1, lease=5)])
    r.granted(0, 1, 1)
    real = os.write
    monkeypatch.setattr(
        "gpushare.node.keep.recovery.os.write",
        lambda fd, data: real(fd, data[:3] if fd == r._journal else data),
    )
    r.granted(0, 1, 5)
    monkeypatch.undo()
    assert (tmp_path / JOURNAL_FILE).read_bytes() == b""  # nothing torn left behind
    assert _records(tmp_path, []).previous[1].lease == 5  # the records, written whole


def test_a_lease_out_while_its_floor_could_not_be_written_is_not_numbered_again(
    tmp_path, monkeypatch
):
    # Seen (a review): on a full disk the floor past a new lease was not written, and the
    # next node numbered its leases from the old floor: the same numbers again.
    r = _records(tmp_path, [_me(1)])

    def full(*args, **kw) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(r.dir, "write", full)
    r.granted(0, 1, 1)  # the floor must move and cannot: the journal's line still fits
    monkeypatch.undo()
    assert _records(tmp_path, []).lease_floor[0] >= 1  # the next lease is past it


def test_a_node_killed_before_it_cut_a_torn_line_leaves_it_torn(tmp_path, monkeypatch):
    # Seen (a review): the journal's open ended the torn line before cutting it, so a
    # node killed between the two left it whole, read as a grant by the next.
    live = [_me(1)]
    r = _records(tmp_path, live)
    r.granted(0, 1, 1)
    assert r.save()
    torn = f"{r.generation} 0 1 10".encode()  # "... 1 10400", cut short
    (tmp_path / JOURNAL_FILE).write_bytes(torn)

    def killed(*args) -> None:
        raise OSError(errno.EIO, "killed here")

    monkeypatch.setattr("gpushare.node.keep.recovery.os.ftruncate", killed)
    _records(tmp_path, live)
    monkeypatch.undo()
    assert (tmp_path / JOURNAL_FILE).read_bytes() == torn  # as it was: still torn
    assert _records(tmp_path, []).previous[1].lease == 0


def test_a_journal_past_its_reading_size_keeps_its_last_lines(tmp_path, monkeypatch):
    # Seen (a review): a journal over the size read back was emptied, with the floor its
    # lines held (whole writes failing all along).
    monkeypatch.setattr("gpushare.node.keep.recovery.JOURNAL_MOST", 64)
    r = _records(tmp_path, [_me(1)])
    r.granted(0, 1, 1)
    gen = r.generation
    leases = range(2, 200_000, 997)
    with open(tmp_path / JOURNAL_FILE, "ab") as f:
        f.write(b"".join(f"{gen} 0 1 {n}\n".encode() for n in leases))
    r2 = _records(tmp_path, [])
    assert r2.lease_floor[0] >= leases[-1]  # the last line's lease: numbered past it
    assert r2.previous[1].lease == leases[-1]
    assert (tmp_path / JOURNAL_FILE).stat().st_size > 64  # nothing thrown away


def test_a_full_disk_leaves_half_a_block_of_leases_before_numbers_could_repeat(
    tmp_path, monkeypatch
):
    # Seen (a review): with the records and the journal both failing, the lease that
    # moved the floor went out past the floor on disk: the next node numbered it again.
    r = _records(tmp_path, [_me(1)])
    r.granted(0, 1, 1)  # the floor on disk: past half a block from here
    real_write = r.dir.write
    calls = {"n": 0}

    def full(*args, **kw) -> None:
        calls["n"] += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(r.dir, "write", full)
    os.close(r._journal)  # and no line fits either
    r._journal = os.open(os.devnull, os.O_RDONLY)
    half = LEASE_BLOCK // 2
    for lease in range(half + 2, half + 5):  # near the floor: each tries a whole write
        r.granted(0, 1, lease)
    assert calls["n"] == 3
    monkeypatch.setattr(r.dir, "write", real_write)  # room again, for one write
    r.granted(0, 1, half + 5)
    monkeypatch.setattr(r.dir, "write", full)
    out = [LEASE_BLOCK + 1, LEASE_BLOCK + 2]  # past the first floor, the disk full again
    for lease in out:
        r.granted(0, 1, lease)
    assert _records(tmp_path, []).lease_floor[0] > max(out)  # never handed out again


def test_a_lease_journal_symlink_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    d = tmp_path / "state"
    d.mkdir()
    os.symlink(victim, d / JOURNAL_FILE)
    r = _records(d, [_me(1, lease=2)])
    r.granted(0, 1, 1)
    r.granted(0, 1, 2)  # without a journal: a whole write, as safe
    assert victim.read_bytes() == b"keep" and os.path.islink(d / JOURNAL_FILE)
    assert _records(d, []).previous[1].lease == 2

"""Processes as the kernel knows them: a process's start time (so a pid that was reused
is never taken for the process it was), the processes that hold a connection (the
workload: the process that attached and every child that inherited its socket), and
signals sent through pidfds, which cannot reach a process that replaced the one meant.

The ``/proc`` root is a parameter (the host's, in a pod with ``hostPID``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
UDIAG_SHOW_PEER = 4
UNIX_DIAG_PEER = 2
_NLMSG = struct.Struct("=IHHII")
_UNIX_DIAG_REQ = struct.Struct("=BBHIII2I")
_UNIX_DIAG_MSG = struct.Struct("=BBBBI2I")
_ATTR = struct.Struct("=HH")
NLMSG_ERROR = 2


@dataclass(frozen=True)
class ProcRef:
    """One process, as it was when seen: its pid, its start time (clock ticks since
    boot, field 22 of /proc/PID/stat) and its real uid. Together they name it for good:
    a later process with the same pid has another start time."""

    pid: int
    start_time: int
    uid: int


def stat_of(pid: int, proc_root: str = "/proc") -> tuple[int, int, int] | None:
    """(start time, process group, session) of ``pid``, or None if it is gone."""
    try:
        text = (Path(proc_root) / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) is in parentheses and may hold anything: split after it.
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19]), int(fields[2]), int(fields[3])
    except (IndexError, ValueError):
        return None


def parent_of(pid: int, proc_root: str = "/proc") -> int:
    """The parent pid of ``pid`` (field 4 of /proc/PID/stat), or 0 if it is gone."""
    try:
        text = (Path(proc_root) / str(pid) / "stat").read_text()
        return int(text.rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


# Deeper than any engine's process tree (vLLM: server, EngineCore, Worker): a chain
# this long is not followed further (a loop in a corrupt or hostile /proc view).
MAX_DEPTH = 64


def descends(pid: int, ancestor: ProcRef, proc_root: str = "/proc") -> bool:
    """Whether ``pid`` was started by ``ancestor`` or by a process it started (its
    chain of parents reaches it), ``ancestor`` still being the process it was."""
    if not same_process(ancestor, proc_root):
        return False
    at = pid
    for _ in range(MAX_DEPTH):
        at = parent_of(at, proc_root)
        if at <= 1:
            return False
        if at == ancestor.pid:
            return True
    return False


def uids_of(pid: int, proc_root: str = "/proc") -> tuple[int, int] | None:
    """(real, effective) uid of ``pid``, or None if it is gone."""
    try:
        for line in (Path(proc_root) / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                real, effective = line.split()[1:3]
                return int(real), int(effective)
    except (OSError, ValueError):
        pass
    return None


def ref_of(pid: int, proc_root: str = "/proc") -> ProcRef | None:
    st, ids = stat_of(pid, proc_root), uids_of(pid, proc_root)
    if st is None or ids is None:
        return None
    return ProcRef(pid, st[0], ids[0])


def peer_inode(sock: socket.socket) -> int:
    """The inode of the other end of a connected Unix socket (sock_diag), 0 if the
    kernel will not say (no unix_diag, or the peer is gone)."""
    try:
        own = os.fstat(sock.fileno()).st_ino
        req = _UNIX_DIAG_REQ.pack(
            socket.AF_UNIX, 0, 0, 0xFFFFFFFF, own, UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF
        )
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(1.0)
            nl.send(
                _NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + req
            )
            data = nl.recv(65536)
    except OSError:
        return 0
    if len(data) < _NLMSG.size + _UNIX_DIAG_MSG.size:
        return 0
    length, kind = _NLMSG.unpack_from(data)[:2]
    if kind == NLMSG_ERROR:
        return 0
    off = _NLMSG.size + _UNIX_DIAG_MSG.size
    while off + _ATTR.size <= min(length, len(data)):
        alen, atype = _ATTR.unpack_from(data, off)
        if alen < _ATTR.size:
            break
        if atype == UNIX_DIAG_PEER and alen >= _ATTR.size + 4:
            return int(struct.unpack_from("=I", data, off + _ATTR.size)[0])
        off += (alen + 3) & ~3
    return 0


def holders_of(inode: int, uid: int, proc_root: str = "/proc") -> list[ProcRef]:
    """Every process of ``uid`` with socket ``inode`` open (it may be shared by forked
    children). Only processes whose real and effective uid are ``uid`` are looked at."""
    target = f"socket:[{inode}]"
    out: list[ProcRef] = []
    try:
        entries = os.scandir(proc_root)
    except OSError:
        return out
    with entries:
        for e in entries:
            if not e.name.isdigit():
                continue
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue  # /proc/PID belongs to the process's effective uid
                fds = os.scandir(os.path.join(e.path, "fd"))
            except OSError:
                continue  # gone, or not ours to look at
            with fds:
                found = False
                for fd in fds:
                    with contextlib.suppress(OSError):
                        if os.readlink(fd.path) == target:
                            found = True
                            break
            if found:
                ref = ref_of(int(e.name), proc_root)
                if ref is not None and ref.uid == uid:
                    out.append(ref)
    return out


def same_process(ref: ProcRef, proc_root: str = "/proc") -> bool:
    """``ref``'s pid is still the process it named (same start time, same uids)."""
    st, ids = stat_of(ref.pid, proc_root), uids_of(ref.pid, proc_root)
    return st is not None and st[0] == ref.start_time and ids == (ref.uid, ref.uid)


def pidfd_signal(ref: ProcRef, sig: int, proc_root: str = "/proc") -> bool:
    """Send ``sig`` to the process ``ref`` names, and to no other: a pidfd is opened on
    the pid, then the pid is checked to still be that process (start time and uids); a
    process that took the pid since has another start time and is left alone. Never this
    process, never pid 0 or 1. True if sent."""
    if ref.pid <= 1 or ref.pid == os.getpid():
        return False
    try:
        fd = os.pidfd_open(ref.pid)
    except OSError:
        return False  # gone
    try:
        # The pidfd holds the process now: if its pid still shows ref's start time, the
        # pidfd is ref's, whatever happens to the pid after this.
        if not same_process(ref, proc_root):
            return False
        try:
            signal.pidfd_send_signal(fd, sig)
        except OSError as e:
            if e.errno not in (errno.ESRCH, errno.EPERM):
                raise
            return False
        return True
    finally:
        os.close(fd)

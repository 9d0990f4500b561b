"""Who is at the other end of a socket, from the kernel: pid and uid from SO_PEERCRED,
pod UID and container ID from ``/proc/PID/cgroup``.

Parses cgroup v1 (one line per hierarchy) and v2 (one ``0::`` line), the cgroupfs and
systemd drivers, and the containerd, CRI-O and Docker forms, e.g.::

    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/\
        cri-containerd-<64 hex>.scope   (one line)
    12:memory:/kubepods/besteffort/pod<uid>/<64 hex>
    0::/kubepods/pod<uid>/crio-<64 hex>

The ``/proc`` root is a parameter, so real file layouts can be tested.
"""

from __future__ import annotations

import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER = re.compile(
    r"^(?:(cri-containerd|crio|docker|containerd)-)?([0-9a-f]{64})(?:\.scope)?$"
)
_RUNTIMES = {
    "cri-containerd": "containerd",
    "containerd": "containerd",
    "crio": "cri-o",
    "docker": "docker",
}
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True)
class CgroupIdentity:
    pod_uid: str = ""  # with dashes, as Kubernetes writes it
    container_id: str = ""  # 64 hex digits
    runtime: str = ""  # containerd, cri-o, docker; "" where the path does not say
    cgroup_version: int = 0  # 1, 2; 0 where unreadable


def peer_credentials(sock: socket.socket) -> Peer:
    """The process at the other end of a Unix socket, as the kernel knows it."""
    pid, uid, gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return Peer(pid, uid, gid)


def parse_cgroup(text: str) -> CgroupIdentity:
    pod, container, runtime = "", "", ""
    v1 = v2 = False
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and not controllers:
            v2 = True
        else:
            v1 = True
        m = _POD.search(path)
        if m and not pod:
            pod = m.group(1).replace("_", "-")
        comps = path.rstrip("/").split("/")
        c = _CONTAINER.match(comps[-1])
        if c and not container:
            container = c.group(2)
            runtime = _RUNTIMES.get(c.group(1) or "", "")
            if not runtime and len(comps) > 1 and comps[-2] == "docker":
                runtime = "docker"  # plain Docker, cgroupfs driver: /docker/<id>
    # A hybrid host shows v1 hierarchies and an empty v2 one: it is v1 that places it.
    return CgroupIdentity(pod, container, runtime, 1 if v1 else 2 if v2 else 0)


def read_identity(pid: int, proc_root: str | Path = "/proc") -> CgroupIdentity:
    """The pod and container of ``pid``; empty where the process is in neither (or gone)."""
    try:
        return parse_cgroup((Path(proc_root) / str(pid) / "cgroup").read_text())
    except OSError:
        return CgroupIdentity()


def groups_of(pid: int, proc_root: str | Path = "/proc") -> set[int]:
    """The process's supplementary groups (``Groups:`` in /proc/PID/status)."""
    try:
        for line in (Path(proc_root) / str(pid) / "status").read_text().splitlines():
            if line.startswith("Groups:"):
                return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()

"""Identity from the kernel: /proc/PID/cgroup in its real forms, SO_PEERCRED."""

from __future__ import annotations

import os
import socket

import pytest

from gpushare.node.host.identity import groups_of, parse_cgroup, peer_credentials, read_identity
from tests.support import FIXTURES

FIX = FIXTURES / "cgroup"
UID = "3c0f5a37-9b1e-4c7a-8d2e-6f0a1b2c3d4e"
CID = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"


@pytest.mark.parametrize(
    ("fixture", "pod", "container", "runtime", "version"),
    [
        ("v2-systemd-containerd", UID, CID, "containerd", 2),
        ("v2-systemd-crio", UID, CID, "cri-o", 2),
        ("v2-cgroupfs-containerd", UID, CID, "", 2),
        ("v2-nested-namespace", UID, CID, "containerd", 2),
        ("v1-cgroupfs-docker", UID, CID, "", 1),
        ("v1-systemd-docker-guaranteed", UID, CID, "docker", 1),
        ("v1-plain-docker", "", CID, "docker", 1),
        ("v2-host-process", "", "", "", 2),
    ],
)
def test_real_cgroup_forms(fixture, pod, container, runtime, version):
    ident = parse_cgroup((FIX / f"{fixture}.txt").read_text())
    assert (ident.pod_uid, ident.container_id, ident.runtime, ident.cgroup_version) == (
        pod,
        container,
        runtime,
        version,
    )


def test_read_identity_takes_the_proc_root(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text((FIX / "v2-systemd-crio.txt").read_text())
    (tmp_path / "4242" / "status").write_text("Name:\tpython\nGroups:\t4 24 1000 \n")
    assert read_identity(4242, tmp_path).pod_uid == UID
    assert read_identity(9999, tmp_path).pod_uid == ""  # gone: no identity, no crash
    assert groups_of(4242, tmp_path) == {4, 24, 1000}
    assert groups_of(9999, tmp_path) == set()


def test_garbage_cgroup_text_gives_nothing():
    assert parse_cgroup("nonsense\n\n::\n").pod_uid == ""


def test_this_process_is_read_from_the_real_proc():
    assert read_identity(os.getpid()).cgroup_version in (1, 2)


def test_peer_credentials_are_the_kernels():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_credentials(a)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.getuid(), os.getgid())

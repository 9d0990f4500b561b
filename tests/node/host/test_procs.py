"""node/host/procs.py's reading of /proc: whether a process descends from another, on a
/proc written here (a chain, a loop, a process that took a pid since)."""

from __future__ import annotations

from pathlib import Path

from gpushare.node.host.procs import ProcRef, descends


def _proc(root: Path, pid: int, ppid: int, start: int = 100, uid: int = 1000) -> None:
    d = root / str(pid)
    d.mkdir()
    # fields after the name: state ppid pgrp session ... starttime is field 22
    rest = ["S", str(ppid), "1", "1"] + ["0"] * 15 + [str(start)]
    (d / "stat").write_text(f"{pid} (a) b) {' '.join(rest)}\n")
    (d / "status").write_text(f"Uid:\t{uid}\t{uid}\t{uid}\t{uid}\n")


def test_descends_follows_the_parents_to_the_session_and_no_further(tmp_path: Path) -> None:
    for pid, ppid in ((10, 1), (20, 10), (30, 20), (40, 1), (50, 50)):
        _proc(tmp_path, pid, ppid)
    root = str(tmp_path)
    head = ProcRef(10, 100, 1000)
    assert descends(30, head, root) and descends(20, head, root)
    assert not descends(10, head, root)  # the session's own process is no member of it
    assert not descends(40, head, root)  # another process of the same user
    assert not descends(50, head, root)  # a loop in /proc: followed no further
    assert not descends(99, head, root)  # gone
    assert not descends(30, ProcRef(10, 99, 1000), root)  # pid 10 is another process now

"""How much host memory a swap may pin: the host's available memory, within the memory
cgroup's room (client/swap/host.py), read from recorded /proc and cgroup trees."""

from __future__ import annotations

from pathlib import Path

from gpushare.client.swap.host import cgroup_memory_room, host_memory_available, mem_available


def test_mem_available_reads_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:  100 kB\nMemAvailable:   2048 kB\n")
    assert mem_available(str(tmp_path)) == 2048 * 1024
    assert mem_available(str(tmp_path / "missing")) == 0


def _proc(tmp: Path, cgroup: str, avail_kib: int = 64 * 2**20) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(f"MemAvailable: {avail_kib} kB\n")  # 64 GiB by default
    return proc


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text)


GiB = 2**30


def test_cgroup_v2_limit_bounds_pinning(tmp_path):
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    cg = tmp_path / "cgroup"
    _write(cg / "kubepods" / "pod1", memory_max=str(8 * GiB), memory_current=str(GiB))
    _write(
        cg / "kubepods" / "pod1" / "ctr",
        memory_max="max",
        memory_current=str(3 * GiB),
        memory_stat=f"anon 1\ninactive_file {GiB}\n",
    )
    assert cgroup_memory_room(str(proc), str(cg)) == 7 * GiB  # the pod's, not the host's 64
    _write(cg / "kubepods" / "pod1" / "ctr", memory_max=str(4 * GiB))
    # the container's own: 4 GiB less 3 in use, of which 1 GiB is reclaimable cache
    assert cgroup_memory_room(str(proc), str(cg)) == 2 * GiB
    assert host_memory_available(str(proc), str(cg)) == 2 * GiB


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    proc = _proc(tmp_path, "12:cpu,cpuacct:/x\n5:memory:/docker/abc\n")
    cg = tmp_path / "cgroup"
    _write(
        cg / "memory" / "docker" / "abc",
        memory_limit_in_bytes=str(6 * GiB),
        memory_usage_in_bytes=str(2 * GiB),
        memory_stat="total_inactive_file 0\n",
    )
    assert host_memory_available(str(proc), str(cg)) == 4 * GiB
    _write(cg / "memory" / "docker" / "abc", memory_limit_in_bytes="9223372036854771712")
    assert cgroup_memory_room(str(proc), str(cg)) is None  # v1's "unlimited"
    assert host_memory_available(str(proc), str(cg)) == 64 * GiB
    assert cgroup_memory_room(str(tmp_path / "none"), str(cg)) is None

"""Load beside a command: busy loops on the CPUs and a writer that keeps the disk busy, as
a build or a training job's checkpoint does on a shared machine; all of it ended when the
command ends (its exit status is this script's), also on Ctrl-C or SIGTERM.

    python benchmarks/load.py [--busy N] [--writer DIR] [--size MiB] -- COMMAND...

``--busy``: N processes each spinning on a CPU (default: one per CPU). ``--writer``: a
process writing ``--size`` MiB files (default 512) in DIR, each flushed to disk
(``fsync``) and removed, one after the other (default: none; ``make test-loaded`` gives
a folder beside the tests' temporary files, on the same disk). The load's processes are
in a process group of their own, ended with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CHUNK = 8 << 20


def busy() -> None:
    """One CPU, spinning until killed."""
    while True:
        pass


def write_files(folder: str, mib: int, stop: Path | None = None) -> None:
    """``mib`` MiB files in ``folder``, each written, flushed and removed, until killed
    (or ``stop`` exists). Prints ``writing`` once its first bytes are written, so that a
    caller knows the disk is busy."""
    block = os.urandom(CHUNK)  # not zeros: nothing compresses or skips them
    said = False
    n = 0
    while stop is None or not stop.exists():
        path = os.path.join(folder, f"load-{os.getpid()}-{n % 2}.bin")
        n += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(max(1, mib * (1 << 20) // CHUNK)):
                os.write(fd, block)
                if not said:
                    print("writing", flush=True)
                    said = True
                if stop is not None and stop.exists():
                    break
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)


@contextlib.contextmanager
def load(busy_loops: int, writer: str | None, mib: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The load's processes, running while the block runs, ended after it whatever
    happens (each in a session of its own, killed with its group)."""
    procs: list[subprocess.Popen[bytes]] = []
    me = [sys.executable, os.path.abspath(__file__)]
    try:
        for _ in range(busy_loops):
            procs.append(subprocess.Popen([*me, "--part", "busy"], start_new_session=True))
        if writer:
            os.makedirs(writer, exist_ok=True)
            w = subprocess.Popen(
                [*me, "--part", "writer", writer, str(mib)],
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(w)
            assert w.stdout is not None
            w.stdout.readline()  # under way
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["--part", "busy"]:
        busy()
    if args[:2] == ["--part", "writer"]:
        write_files(args[2], int(args[3]))
        return 0
    if "--" not in args:
        raise SystemExit("usage: load.py [--busy N] [--writer DIR] [--size MiB] -- COMMAND...")
    cut = args.index("--")
    ap = argparse.ArgumentParser(prog="load.py")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--writer", default="")
    ap.add_argument("--size", type=int, default=512)
    opts = ap.parse_args(args[:cut])
    command = args[cut + 1 :]
    if not command:
        raise SystemExit("load.py: no command after --")
    writer = opts.writer or None
    own = None
    if writer == "auto":  # a folder of its own on the temporary files' disk
        own = tempfile.mkdtemp(prefix="gpushare-load-", dir=os.environ.get("TMPDIR", "/var/tmp"))
        writer = own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below runs
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started ignored
    t0 = time.monotonic()
    try:
        with load(opts.busy, writer, opts.size):
            what = f"{opts.busy} busy loops" + (
                f", a {opts.size} MiB writer in {writer}" if writer else ""
            )
            print(f"load.py: {what} beside: {' '.join(command)}", flush=True)
            rc = subprocess.call(command)
    except KeyboardInterrupt:
        rc = 130
    finally:
        if own:
            with contextlib.suppress(OSError):
                for f in os.listdir(own):
                    os.unlink(os.path.join(own, f))
                os.rmdir(own)
    print(f"load.py: exit {rc} after {time.monotonic() - t0:.0f} s under load", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Files the node creates, made so that no one else can steer them: every file is opened
relative to a directory the node checked (its own, not a symlink, writable by no one
else), with ``O_NOFOLLOW`` and ``O_EXCL``, never truncated under a reader (a new file
is written, flushed to disk and renamed over the old one), and no wider than it needs.

A planted symlink, a directory another user can write, a file of another owner where
one of the node's should be: each is refused with a message naming the path and the fix,
never followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC
_READ_MOST = 1 << 24  # a file of the node's own bigger than this is not one


class UnsafePath(OSError):
    """A path the node will not use (the message says why and what to do)."""


class SafeDir:
    """A directory the node owns, held open: every file in it is reached from this
    handle, so a path component replaced later changes nothing.

    ``path`` is made (mode ``mode``) if missing; its last component must not be a
    symlink, it must belong to this process's user (or root), and no one else may write
    in it unless it is sticky (as /tmp is: then only files of this user are touched)."""

    def __init__(self, path: str | os.PathLike[str], mode: int = 0o755) -> None:
        self.path = os.path.abspath(path)
        try:
            os.makedirs(self.path, mode=mode, exist_ok=True)
        except OSError as e:
            raise UnsafePath(
                f"cannot create {self.path}: {e.strerror}; choose another path"
            ) from None
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
        except OSError as e:
            raise UnsafePath(
                f"{self.path} is not a directory the node can use ({e.strerror}: a symlink"
                " is never followed): remove it or choose another path"
            ) from None
        st = os.fstat(self.fd)
        euid = os.geteuid()
        why = ""
        if st.st_uid not in (euid, 0):
            why = f"it belongs to uid {st.st_uid}, not {euid}"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            why = f"others may write in it (mode {stat.S_IMODE(st.st_mode):o})"
        if why:
            os.close(self.fd)
            raise UnsafePath(
                f"{self.path}: {why}; the node keeps its sockets and files only in a"
                " directory no one else can change: chmod go-w it or choose another path"
            )
        self.sticky = bool(st.st_mode & 0o022)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _own(self, name: str, st: os.stat_result, uid: int | None = None) -> None:
        want = os.geteuid() if uid is None else uid
        if not stat.S_ISREG(st.st_mode) or st.st_uid != want or st.st_nlink != 1:
            raise UnsafePath(
                f"{self.join(name)} is not a file of the node's (a {_kind(st.st_mode)} of uid"
                f" {st.st_uid}, {st.st_nlink} links): remove it"
            )

    def read(self, name: str, most: int = _READ_MOST) -> bytes | None:
        """A file of this user's, or None where there is none."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _OPEN, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(
                    f"{self.join(name)} is a symlink, which the node never follows: remove it"
                ) from None
            raise UnsafePath(f"cannot read {self.join(name)}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            self._own(name, st)
            if st.st_size > most:
                raise UnsafePath(f"{self.join(name)} is {st.st_size} bytes, more than {most}")
            return os.read(fd, most + 1)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, mode: int = 0o600, uid: int | None = None) -> None:
        """Replace ``name`` with a new file holding ``data``: written to a new name,
        flushed, then renamed over the old one (a reader keeps the old file whole;
        nothing is ever truncated). ``uid``: the new file's owner (the node's user by
        default)."""
        tmp = f".{name}.{secrets.token_hex(6)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, mode, dir_fd=self.fd)
        try:
            try:
                os.fchmod(fd, mode)  # whatever the umask
                if uid is not None and uid != os.geteuid():
                    os.fchown(fd, uid, -1)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def keep_or_write(
        self, name: str, data: bytes, mode: int = 0o600, uid: int | None = None
    ) -> bool:
        """Keep ``name`` if it is already a file of ``uid``'s, mode ``mode``, of the same
        size (workloads may have it mapped: it is never touched then); else
        :meth:`write` it anew. True if written."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            with contextlib.suppress(UnsafePath):
                self._own(name, st, uid)
                if stat.S_IMODE(st.st_mode) == mode and st.st_size == len(data):
                    return False
        self.write(name, data, mode, uid)
        return True

    def append(self, name: str, mode: int = 0o600, end_line: bool = True) -> int:
        """A file of this user's opened to append lines to (made if missing), never
        through a symlink; the caller closes the descriptor. A last line a killed writer
        left unended is ended first (``end_line``), so that the next line is not joined
        to it; a caller that cuts such a line off itself says ``end_line=False``."""
        fd = os.open(name, os.O_RDWR | os.O_APPEND | os.O_CREAT | _OPEN, mode, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            self._own(name, st)
            os.fchmod(fd, mode)
            if end_line and st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
                os.write(fd, b"\n")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    return "special file"


def parent_dir(path: str, mode: int = 0o755) -> tuple[SafeDir, str]:
    """The checked directory of ``path`` and its file name."""
    p = Path(os.path.abspath(path))
    return SafeDir(p.parent, mode), p.name

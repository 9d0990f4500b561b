"""What the node keeps to recover its sessions after it restarts, and the recovery window.

Workloads outlive the node: killed and started again, it must learn who held what before
it grants anything, or two sessions hold one GPU and memory is booked twice. So it keeps,
in a file of its own (``gpushare.node.keep.safefs``: a new file, flushed, renamed over the
old), each session's identity as the kernel gave it (pid and the process's start time,
uid, pod and container from the cgroup), its GPU, limit and name, whether a freeze
stopped it; the next session id (ids are never used twice); and, per GPU, a floor for
lease numbers (leases are numbered on across restarts). Beside it, a key the node signs
each lease with: a workload that comes back claiming a lease shows the token it was
granted with, so only leases this node (or the one before it) granted are given back.

The records are written whole a moment after a change (an attach, a release), on a
thread of their own: a whole write costs a flush (milliseconds, seconds while another
process fills the disk), and no grant, revoke or status waits for it. A grant cannot
wait for that write, nor pay for it, yet its holder may claim it at the very next
restart: so each grant goes first, as one line, into a journal beside the records (an
append, no flush: in the kernel's page cache, which a killed node does not lose; a
machine that loses power loses its workloads too). Each whole write numbers itself (its
generation) and the lines after it carry that number: two journal files take turns, the
one the lines of the write in flight go to, and the one the write before it left, which
is emptied once the new file is on disk; a line counts only under a generation the file
on disk does not hold (its own or a later one), so a line a later whole write already
holds is never read back over it. A new session's record is on disk before it is
welcomed (:meth:`Recovery.written`): one that cannot be written is refused at attach.

On start, the sessions on record whose processes still run are *expected*: nothing is
granted until each has re-registered (matched by pid, start time, uid, cgroup and the
session id it names among its process's records, never by its word alone) or the
window (``recovery_window`` seconds) ends. A re-registered session gets its old id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from gpushare.node.host.procs import ProcRef, same_process
from gpushare.node.keep.safefs import SafeDir, UnsafePath

log = logging.getLogger("gpushare.node.recovery")

STATE_FILE = "sessions.state"
JOURNAL_FILE = "leases.journal"  # the grants since the state file was last written
# The two journals, in turn: generation n's lines go to JOURNALS[(n + 1) % 2].
JOURNALS = (JOURNAL_FILE, JOURNAL_FILE + ".1")
JOURNAL_MOST = 16 << 20  # read back at most (it is emptied at every whole write)
KEY_FILE = "lease.key"
LEASE_BLOCK = 100_000  # lease numbers reserved on disk at a time
ID_BLOCK = 1_000  # session ids reserved on disk at a time
BOOT_ID = "/proc/sys/kernel/random/boot_id"


class SessionRecord(msgspec.Struct, kw_only=True):
    id: int
    gpu: int
    pid: int
    start_time: int  # 0: unknown (never matched)
    uid: int
    pod_uid: str = ""
    container_id: str = ""
    limit: int
    name: str
    claim: str = ""  # the DRA ResourceClaim it attached by: it may name it again after a restart
    claim_terms: tuple[int, float, float] = (0, 0.0, 0.0)  # its request, weight, compute limit
    stopped: list[tuple[int, int]] = []  # (pid, start time) a freeze stopped
    # As the node last wrote them: its memory, and the lease it held (0: none). Only
    # that lease's token is good after a restart, and only once.
    resident: int = 0
    swapped: int = 0
    lease: int = 0
    # Its family (core/families.py): the session it is a process of, or its own id when
    # processes of its own are members (0: neither). A restart rebuilds the family from
    # this, never from what a client says.
    family: int = 0

    def ref(self) -> ProcRef:
        return ProcRef(self.pid, self.start_time, self.uid)


class IdsUnavailable(OSError):
    """No session id can be reserved on disk (the message names the directory and fix)."""


class Saved(msgspec.Struct, kw_only=True):
    version: int = 1
    boot_id: str = ""  # records of another boot are void: no process outlives a reboot
    next_session: int = 1  # ids below this may have been used
    lease_floor: list[int] = []  # per GPU
    sessions: list[SessionRecord] = []
    generation: int = 0  # the journal's lines of this generation come after this file


@dataclass
class Figures:
    """What the recovery window saw (the ``recovery`` events' figures)."""

    expected: int = 0
    returned: int = 0
    started: float = 0.0  # monotonic

    @property
    def missing(self) -> int:
        return self.expected - self.returned


def boot_id() -> str:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


class Recovery:
    """The records and the window. ``live`` gives the records of the sessions attached
    now (the node's connections and arbiters); :meth:`save` writes them."""

    def __init__(
        self,
        folder: SafeDir,
        gpus: int,
        live: Callable[[], Iterable[SessionRecord]],
        proc_root: Callable[[], str],
    ) -> None:
        self.dir, self.gpus, self.live, self.proc_root = folder, gpus, live, proc_root
        self.boot = boot_id()
        self.next_session = 1
        self.id_floor = 1  # on disk: no id below it is handed out again
        self.lease_floor = [0] * gpus
        self.expected: dict[int, SessionRecord] = {}  # still to come back
        self.previous: dict[int, SessionRecord] = {}  # the last node's, processes alive
        self.figures = Figures()
        self._failing_why = ""
        self.open = False  # the window: only sessions on record attach meanwhile
        self._failing = False  # a write failed: said once, until one succeeds again
        self.key = self._key()
        self._soon: asyncio.TimerHandle | None = None
        self._soon_delay = 0.0
        self._held = False  # the node is stopping: the records stay as they are
        self.generation = 0  # of the last whole write taken: the journal's lines carry it
        self._journals: list[int] = []  # both journals' descriptors (none: no journal)
        self._sizes = [0, 0]  # their whole lines' bytes
        self._journal: int | None = None  # the one this generation's lines go to
        self._at = 0  # its index
        self._disk_floor = [0] * gpus  # the lease floors last written
        self._disk_generation = 0  # the state file's on disk
        # New sessions' records, in every whole write from before their welcome on.
        self.pending: dict[int, SessionRecord] = {}
        # Whole writes on a thread of their own, one at a time, in generation order: one
        # in flight, the next taken once it is done (however many were asked for).
        self._pool: ThreadPoolExecutor | None = None
        self._writing = False
        self._again = False
        self._idle = threading.Event()  # no whole write is on the thread
        self._idle.set()
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[bool]] = []  # for a write taken after they asked

    # --- at start ---------------------------------------------------------------------

    def _key(self) -> bytes:
        """The key leases are signed with: the last node's, or a new one. Anything but a
        file of the node's where it should be (a planted symlink, say) is never followed:
        it is replaced by a new file (renamed over it), or, where the directory does not
        allow that, the node stops with the one line that says what to do."""
        try:
            key = self.dir.read(KEY_FILE, most=64)
        except UnsafePath as e:
            log.warning("%s; replacing it with a new key (leases signed before are void)", e)
            key = None
        if key is None or len(key) < 32:
            key = secrets.token_bytes(32)
            try:
                self.dir.write(KEY_FILE, key, mode=0o600)
            except OSError as e:
                raise UnsafePath(
                    f"cannot write the lease key {self.dir.join(KEY_FILE)} ({e.strerror}):"
                    f" remove what is there (rm {self.dir.join(KEY_FILE)}) or set"
                    " recovery_dir to a directory of the node's own"
                ) from None
        return key

    def load(self) -> list[SessionRecord]:
        """The last node's records; the sessions whose processes still run are expected
        (returned). A file of another boot, or one that cannot be read, is void."""
        try:
            raw = self.dir.read(STATE_FILE)
            saved = msgspec.json.decode(raw, type=Saved) if raw else Saved(boot_id=self.boot)
        except (UnsafePath, msgspec.DecodeError) as e:
            log.warning("session records not usable (%s): starting without them", e)
            saved = Saved(boot_id=self.boot)
        saved = bounded(saved)
        self.next_session = self.id_floor = max(1, saved.next_session)
        floors = list(saved.lease_floor)[: self.gpus]
        self.lease_floor = floors + [0] * (self.gpus - len(floors))
        self._disk_floor = list(self.lease_floor)
        lines = self._open_journals()
        grants = _grants(lines, saved.generation)
        # Lines of whole writes that never reached the disk come after the file too; the
        # next whole write numbers itself past them, so that it holds them all.
        self.generation = self._disk_generation = saved.generation
        self.generation = max(self.generation, _last_generation(lines, saved.generation))
        self._switch(self.generation)
        for gpu, _, lease in grants:  # a lease out with its floor not on disk (a full disk)
            if gpu < self.gpus:
                self.lease_floor[gpu] = max(self.lease_floor[gpu], lease)
        if saved.boot_id != self.boot:
            return []  # another boot: no process of then runs now
        _replay(saved, grants)
        root = self.proc_root()
        alive = [
            r
            for r in saved.sessions
            if 0 <= r.gpu < self.gpus and r.start_time and same_process(r.ref(), root)
        ]
        self.previous = {r.id: r for r in alive}
        self.expected = dict(self.previous)
        return alive

    def _open_journals(self) -> bytes:
        """Both journals' whole lines as the last node left them, and both opened to
        append to; where either cannot be opened, neither is (every grant is then a
        whole write: slower, as safe)."""
        for fd in self._journals:
            os.close(fd)
        self._journals, self._journal = [], None
        lines, fds = b"", []
        for name in JOURNALS:
            got = self._open_journal(name)
            if got is None:
                fds.append(-1)
                continue
            fds.append(got[0])
            self._sizes[len(fds) - 1] = got[1]
            lines += got[2]
        if -1 in fds:
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        else:
            self._journals = fds
        return lines

    def _open_journal(self, name: str) -> tuple[int, int, bytes] | None:
        """A journal's whole lines as the last node left them (its last
        :data:`JOURNAL_MOST` bytes: a journal that large has outlived many failed whole
        writes), and the journal opened to append to, a last line it left torn cut off
        (its lease's digits cut short would still read as a number): its descriptor,
        size and lines."""
        try:
            fd = self.dir.append(name, end_line=False)
        except (OSError, UnsafePath) as e:
            log.warning("cannot open the lease journal (%s): each grant writes the records", e)
            return None
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - JOURNAL_MOST)
            data = os.pread(fd, size - start, start)
            if start:  # from within a line: from the next one
                data = data[data.find(b"\n") + 1 :]
            lines = data[: data.rfind(b"\n") + 1]
            torn = len(data) - len(lines)
            os.ftruncate(fd, size - torn)
        except OSError as e:
            os.close(fd)
            log.warning("cannot read the lease journal (%s): each grant writes the records", e)
            return None
        return fd, size - torn, lines

    def _switch(self, generation: int) -> None:
        """The journal ``generation``'s lines go to (the other holds the generation
        before, emptied once this one's whole write is on disk)."""
        self._at = (generation + 1) % 2
        self._journal = self._journals[self._at] if self._journals else None

    def _append(self, line: str) -> bool:
        """``line`` appended to the journal, whole; a short write (a full disk) is cut
        back off, so no torn line is left for the next one to join."""
        if self._journal is None:
            return False
        data = line.encode()
        try:
            n = os.write(self._journal, data)
        except OSError as e:
            n, why = -1, e.strerror or str(e)
        else:
            why = "a short write"
        if n == len(data):
            self._sizes[self._at] += n
            return True
        with contextlib.suppress(OSError):
            os.ftruncate(self._journal, self._sizes[self._at])
        log.warning("cannot append to the lease journal (%s): writing the records", why)
        return False

    # --- ids, leases, tokens -------------------------------------------------------------

    def new_id(self) -> int:
        """A session id never used before, on this node or the ones before it: ids are
        reserved a block at a time, the block on disk with the session's record
        (:meth:`written`) before its workload hears its id, so none is handed out that a
        later node could hand out again."""
        if self.next_session >= self.id_floor:
            self.id_floor = self.next_session + ID_BLOCK
        sid = self.next_session
        self.next_session += 1
        return sid

    async def written(self, rec: SessionRecord) -> None:
        """A new session's record on disk, with the id it names reserved, in a whole
        write on the records' thread (the loop goes on meanwhile); or
        :class:`IdsUnavailable` when it cannot be written (a full disk): a session whose
        record is not on disk would be a stranger to the next node, so none is
        welcomed. The record stays in every whole write until :meth:`settled`."""
        self.pending[rec.id] = rec
        if not await self.on_disk():
            self.pending.pop(rec.id, None)
            if self._held:
                raise IdsUnavailable("the node is stopping: attach to the next one")
            raise IdsUnavailable(
                f"cannot save the session's record (session ids are handed out only on"
                f" record): writing to {self.dir.path} failed ({self._failing_why}): free"
                " space there, or set recovery_dir to another directory"
            )

    def settled(self, sid: int, attached: bool) -> None:
        """A new session's attach is done: attached (its record is the connection's
        now), or refused (its record is dropped, in a whole write soon)."""
        if self.pending.pop(sid, None) is not None and not attached:
            self.save_soon(0.0)

    def token(self, gpu: int, sid: int, lease: int) -> str:
        msg = f"{gpu}:{sid}:{lease}".encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()[:32]

    def claim_wrong(self, rec: SessionRecord | None, lease: int, token: str) -> str:
        """Why a claim of ``lease`` with ``token`` is not believed ('' when it is): only
        the token of the lease ``rec`` says its session held when the last node wrote it
        down is; a lease released before the crash, or one given back already (its
        session was granted anew since, and that is on record), is not."""
        if rec is None:
            return "the session is not on record"
        if not (lease and token):
            return "it shows no lease and token"
        if lease != rec.lease:
            return f"the lease on record is {rec.lease or 'none'}"
        if not hmac.compare_digest(self.token(rec.gpu, rec.id, lease), token):
            return "its token is not that lease's"
        return ""

    def granted(self, gpu: int, sid: int, lease: int) -> None:
        """``lease`` is about to go out to session ``sid``: on disk first, so that its
        holder finds it on record whenever the node is killed: a line in the journal (a
        write to the page cache, no flush); a whole write at once only where there is
        no journal, or the line does not fit (a full disk)."""
        if self._held:
            return
        line = f"{self.generation} {gpu} {sid} {lease}\n"
        # The floor moves half a block ahead of the leases, in a whole write on the
        # records' thread (until one is on disk the journal's lines carry the leases
        # past it: the next node numbers past them); on a full disk every grant tries
        # again, and the floor on disk still covers the leases for half a block more.
        near = lease + LEASE_BLOCK // 2 >= self._disk_floor[gpu]
        if near:
            self.lease_floor[gpu] = max(self.lease_floor[gpu], lease + LEASE_BLOCK)
        if not self._append(line):
            self.save()
        elif near:
            self._save_background()

    # --- re-registering ----------------------------------------------------------------

    def match(
        self,
        claimed: int,
        proc: ProcRef | None,
        pod_uid: str,
        container_id: str,
        gpu: int,
        limit: int,
        taken: Mapping[int, object],
    ) -> SessionRecord | None:
        """The record of the session ``claimed`` if this process is the one it names
        (pid, start time, uid; pod and container), on the same GPU with the same limit,
        and no live session has its id."""
        r = self.previous.get(claimed)
        if r is None or proc is None or claimed in taken:
            return None
        if (r.pid, r.start_time, r.uid) != (proc.pid, proc.start_time, proc.uid):
            return None
        if (r.pod_uid, r.container_id, r.gpu, r.limit) != (pod_uid, container_id, gpu, limit):
            return None
        return r

    def returned(self, sid: int) -> bool:
        """A record's session is back; True when no one else is expected."""
        self.previous.pop(sid, None)
        if self.expected.pop(sid, None) is not None:
            self.figures.returned += 1
        return not self.expected

    # --- writing -----------------------------------------------------------------------

    def _snapshot(self) -> tuple[int, bytes, list[int]]:
        """The records of the sessions attached now, the new ones not yet welcomed and
        the ones still expected beside them, the next id and the lease floors, as the
        next generation; the journal's lines are of that generation from here on."""
        now = {r.id: r for r in self.live()}
        for r in (*self.pending.values(), *self.previous.values()):
            now.setdefault(r.id, r)  # a late returner still gets its id back
        self.generation += 1
        saved = Saved(
            boot_id=self.boot,
            next_session=self.id_floor,
            lease_floor=list(self.lease_floor),
            sessions=list(now.values()),
            generation=self.generation,
        )
        self._switch(self.generation)
        return saved.generation, msgspec.json.encode(saved), saved.lease_floor

    def _write(self, generation: int, data: bytes, floors: list[int]) -> bool:
        """A snapshot on disk (a new file, flushed, renamed over the old), then the
        journal of the generation before it emptied (its lines are in the new file).
        On the records' thread, or on the loop for :meth:`save`; never two at once."""
        with self._lock:
            if generation <= self._disk_generation:
                return True  # a later one is on disk already (never older than it)
            try:
                self.dir.write(STATE_FILE, data, mode=0o600)
            except OSError as e:  # a full disk must not stop the node: it says so, once
                self._failing_why = e.strerror or str(e)
                if not self._failing:
                    log.error(
                        "cannot write session records to %s: %s (new sessions are refused"
                        " until it can)",
                        self.dir.path,
                        self._failing_why,
                    )
                self._failing = True
                return False
            if self._failing:
                log.info("session records written to %s again", self.dir.path)
            self._failing = False
            self._disk_generation = generation
            self._disk_floor = floors
            if self._journals:  # not the one lines go to now: that is generation's
                with contextlib.suppress(OSError):
                    os.ftruncate(self._journals[generation % 2], 0)
                    self._sizes[generation % 2] = 0
            return True

    def save(self) -> bool:
        """A whole write now, on the caller's thread (the one on the records' thread, if
        any, first): for the node stopping, a tool, or a grant with no journal to go to.
        Never for what a running node only must not tell before it is on disk (a
        family's limits, a freeze): :meth:`then`. True if written."""
        if self._held:
            return False
        self._idle.wait()
        return self._write(*self._snapshot())

    def _save_background(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop (a tool, a test): at once
            self.save()
        else:
            self.save_soon(0.0)

    def _start(self) -> None:
        """A whole write on the records' thread, of the records as they are now; if one
        is in flight, the next once it is done."""
        if self._held:
            self._wake(self._waiters, False)
            return
        if self._writing:
            self._again = True
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gpushare-records")
        snap = self._snapshot()
        waiters, self._waiters = self._waiters, []
        self._writing, self._again = True, False
        self._idle.clear()
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._job, *snap)
        fut.add_done_callback(lambda f: self._done(f, waiters))

    def _job(self, generation: int, data: bytes, floors: list[int]) -> bool:
        try:
            return self._write(generation, data, floors)
        finally:
            self._idle.set()

    def _done(self, fut: asyncio.Future[bool], waiters: list[asyncio.Future[bool]]) -> None:
        self._writing = False
        ok = False
        if not fut.cancelled():
            if fut.exception() is not None:
                log.error("writing session records failed: %r", fut.exception())
            else:
                ok = fut.result()
        self._wake(waiters, ok)
        if (self._again or self._waiters) and not self._held:
            self._start()

    @staticmethod
    def _wake(waiters: list[asyncio.Future[bool]], ok: bool) -> None:
        for w in waiters:
            if not w.done():
                w.set_result(ok)
        waiters.clear()

    def on_disk(self) -> asyncio.Future[bool]:
        """Done once a whole write taken from now on, on the records' thread, is on disk:
        True; False if it failed or the node is stopping. The loop goes on meanwhile."""
        w: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if self._held:
            w.set_result(False)
            return w
        self._waiters.append(w)
        if not self._writing:
            self._start()
        return w

    def then(self, fn: Callable[[bool], None]) -> None:
        """``fn(ok)`` once the records as they are now are on disk (:meth:`on_disk`), on
        the loop; without a loop (a tool, a test), after a whole write at once."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            fn(self.save())
            return
        self.on_disk().add_done_callback(lambda w: fn(not w.cancelled() and w.result()))

    def save_soon(self, delay: float = 0.1) -> None:
        """A whole write on the records' thread within ``delay`` seconds, once for any
        number of calls meanwhile: ``0`` after the handlers ready now have run (attaches
        arriving together cost one write), longer for a detach (a record left a moment
        too long only makes a restart wait for it)."""
        if self._soon is not None:
            if self._soon_delay <= delay:
                return  # one is due as soon already
            self._soon.cancel()
        self._soon_delay = delay
        self._soon = asyncio.get_running_loop().call_later(delay, self._save_now)

    def _save_now(self) -> None:
        self._soon = None
        self._start()

    def hold(self) -> None:
        """The node stops: the sessions on record now are kept for the next node (their
        connections end, their workloads go on), whatever happens while it stops."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        self.save()
        self._held = True
        self._wake(self._waiters, False)
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def forget_dead(self) -> None:
        """Records of the last node whose processes have ended are dropped."""
        root = self.proc_root()
        for sid in [i for i, r in self.previous.items() if not same_process(r.ref(), root)]:
            self.previous.pop(sid)
            self.expected.pop(sid, None)


# The most any count read back from disk may be (ids, leases, generations, the floors):
# a node granting a million leases a second for 100,000 years stays below it, and every
# figure derived from it (a floor a block ahead, a lease after it) stays within what the
# wire carries (64 bits). A figure past it is disk corruption (or root's hand): dropped,
# said in the log, never carried on into the arbiter or the wire.
COUNT_MOST = 2**62
PID_MOST = 1 << 22  # the kernel's PID_MAX_LIMIT
UID_MOST = 2**32 - 1
SIZE_MOST = 2**50  # gpushare.units.MAX_SIZE: 1024 TiB
TEXT_MOST = 253  # a name, as Kubernetes bounds one (hello_bounds.TEXT_BOUNDS)
STOPPED_MOST = 4096  # processes a freeze stopped, per session


def _count(x: object, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= COUNT_MOST


def _record_wrong(r: SessionRecord) -> str:
    """Why a record read back cannot be a session's ('' when it can)."""
    for name in ("id", "gpu", "start_time", "lease", "family"):
        if not _count(getattr(r, name), 1 if name == "id" else 0):
            return f"{name} {getattr(r, name)} is out of range"
    if not 0 < r.pid <= PID_MOST or not 0 <= r.uid <= UID_MOST:
        return f"pid {r.pid} or uid {r.uid} is out of range"
    for name in ("limit", "resident", "swapped"):
        if not 0 <= getattr(r, name) <= SIZE_MOST:
            return f"{name} {getattr(r, name)} is not a size"
    if r.resident + r.swapped > r.limit:
        return f"resident + swapped ({r.resident} + {r.swapped}) is over its limit {r.limit}"
    if max(len(r.name), len(r.pod_uid), len(r.container_id), len(r.claim)) > TEXT_MOST:
        return "a text is too long"
    if len(r.stopped) > STOPPED_MOST or any(
        not (0 < pid <= PID_MOST and _count(start)) for pid, start in r.stopped
    ):
        return "its stopped processes are out of range"
    return ""


def bounded(saved: Saved) -> Saved:
    """``saved`` with every figure within its bounds, above as well as below: a record
    with one that is not dropped, a count that is not replaced by what the sane records
    show (each said in the log). A figure past 64 bits carried on would stop every grant
    of its GPU (a lease the wire cannot carry), across restarts."""
    keep = []
    for r in saved.sessions:
        why = _record_wrong(r)
        if why:
            log.warning("session record %.40r dropped: %s", r.id, why)
        else:
            keep.append(r)
    floors = []
    for gpu, floor in enumerate(saved.lease_floor):
        if _count(floor):
            floors.append(floor)
            continue
        floors.append(max([r.lease for r in keep if r.gpu == gpu], default=0))
        log.warning("lease floor of GPU %d (%.40r) dropped: from the records, %d", gpu, floor,
                    floors[-1])  # fmt: skip
    nxt = saved.next_session
    if not _count(nxt, 1):
        nxt = max([r.id for r in keep], default=0) + 1
        log.warning(
            "next session id (%.40r) dropped: from the records, %d", saved.next_session, nxt
        )
    gen = saved.generation
    if not _count(gen):
        log.warning("records' generation (%.40r) dropped: the journal is not read", gen)
        gen = 0
    return msgspec.structs.replace(
        saved, sessions=keep, lease_floor=floors, next_session=nxt, generation=gen
    )


GENERATIONS_AHEAD = 1 << 32  # a line's generation past the file's by more: not one


def _lines(lines: bytes, generation: int) -> list[tuple[int, int, int, int]]:
    """The journal's grants the file of ``generation`` does not hold (of its generation
    or a later one), as (generation, GPU, session, lease); a line no grant wrote is
    skipped, and one whose figures are out of bounds (above as well as below) is dropped,
    said in the log."""
    out = []
    dropped = 0
    for line in lines.split(b"\n"):
        try:
            gen, gpu, sid, lease = map(int, line.split())
        except ValueError:
            continue
        if not (_count(gen) and _count(gpu) and _count(sid, 1) and _count(lease, 1)):
            dropped += 1
        elif generation <= gen <= generation + GENERATIONS_AHEAD:
            out.append((gen, gpu, sid, lease))
    if dropped:
        log.warning("lease journal: %d lines with figures out of bounds dropped", dropped)
    return out


def _grants(lines: bytes, generation: int) -> list[tuple[int, int, int]]:
    """The journals' grants after the file of ``generation``, as (GPU, session, lease),
    in the order they were granted (a GPU's leases are numbered up: the two journals'
    lines are read one after the other)."""
    return sorted(((g, s, n) for _, g, s, n in _lines(lines, generation)), key=lambda x: x[2])


def _last_generation(lines: bytes, generation: int) -> int:
    return max((gen for gen, *_ in _lines(lines, generation)), default=generation)


def _replay(saved: Saved, grants: list[tuple[int, int, int]]) -> None:
    """The grants onto ``saved``'s records: each session's lease, the last one it was
    granted (the state file holds its releases until then)."""
    records = {r.id: r for r in saved.sessions}
    for gpu, sid, lease in grants:
        r = records.get(sid)
        if r is not None and r.gpu == gpu:
            r.lease = lease

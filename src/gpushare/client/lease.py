"""A session's lease, as a state machine: asking for the GPU, swapping in, holding,
yielding, and what each message from the node means in each state.

::

             ask                grant               memory back
    IDLE ----------> ACQUIRING ------> SWAPPING_IN -------------> HOLDING
     ^ ^                 ^  ^              |                      |    |
     | |  withdraw       |  +--------------+ node gone            |    |
     | +-----------------+    (stop, re-register, ask again)      |    |
     |                   |                                        |    |
     |                   +--------- YIELDING <---- yield ---------+    |
     |                              (swapping out                      |
     +------------------------------ what the revoke asked) <-- end ---+

(docs/client.md has the table of transitions.) While ACQUIRING, the thread that waits
for the grant also swaps in ahead of it when the node says (a Prefetch: the lease is
another's, this session is next): memory only, within the room the node gives, no GPU
work; it tells the node when it is done with each ask, and a grant ends it.

The connection (:class:`~gpushare.client.transport.Link`) is apart: while it is AWAY a
burst in progress goes on and a new one waits; ENDED, CLOSED and FORKED end every burst
at its next safe point. Everything here runs under the condition the lease shares with
its transport, except the swaps themselves (under their own lock, so the reader thread
can say the node went away while memory moves) and :attr:`Lease.ready`, the one flag
:meth:`Session.checkpoint` reads with no lock.

Invariants: memory moves into the GPU only within a grant of the node the link is
connected to now (checked before every piece); at most one request of this session is
outstanding at the node; a grant that comes when none is asked for (it crossed a
withdrawal or a release) is never taken, and the release already sent gives it back.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

import msgspec

from gpushare import protocol as p
from gpushare.client.lease_messages import Messages
from gpushare.client.swap.base import SwapBackend, SwapHooks
from gpushare.client.transport import LIVE, Link, Peer, Transport
from gpushare.errors import DaemonUnavailableError, GpushareError, SwapError

log = logging.getLogger("gpushare.client.lease")
_now = time.monotonic


class Phase(enum.Enum):
    IDLE = "idle"  # no burst
    ACQUIRING = "acquiring"  # asked; waiting for the grant
    SWAPPING_IN = "swapping_in"  # granted: the memory comes back (within the room) first
    HOLDING = "holding"  # GPU work may be issued
    YIELDING = "yielding"  # released; swapping out what the revoke asked


class NodeLost(SwapError):
    """The node that granted a swap-in went away: the swap-in stops at the next piece."""


class PrefetchPaused(SwapError):
    """A prefetch stops at the next piece: its room is used up, or the grant came."""

    def __init__(self, seq: int) -> None:
        super().__init__(f"prefetch {seq} paused")
        self.seq = seq  # the last ask it acted on


class Lease:
    """The lease of one session; :class:`~gpushare.client.session.Session` is its face."""

    def __init__(
        self,
        link: Callable[[Peer], Transport],
        backend: Callable[[SwapHooks], SwapBackend],
        cond: threading.Condition,
        welcome: p.Welcome,
        reconnect_timeout: float,
        pid: int,
    ) -> None:
        """``link`` and ``backend`` build this lease's connection and swap backend, each
        given the lease as what it tells (its peer; its hooks) when it is built."""
        self.cond = cond
        self.memory_limit = welcome.memory_limit
        # 0 only from a node older than issue 37 (it meant the limit); else filled in
        self.memory_request = welcome.memory_request or welcome.memory_limit
        self.weight = welcome.weight
        self.gpu = welcome.gpu
        self.idle_release_s = welcome.idle_release_s
        self.burst_idle_s = welcome.idle_release_s  # this lease's (a grant may say less)
        self.reconnect_timeout = reconnect_timeout
        self.pid = pid
        self.phase = Phase.IDLE
        self.ready = False  # HOLDING, no revoke pending, link live: checkpoint() reads it
        self.last_work = 0.0  # written by every checkpoint(), unlocked
        self.lease = 0  # the node's number for the lease granted (0: none)
        self.token = ""  # the node's signature of that lease: it claims it back after a restart
        self.grant: p.Grant | None = None  # the answer to our request, not taken yet
        self.revoke: p.Revoke | None = None  # pending, for self.lease
        self.rejoin = False  # yielding: the burst asks again once swapped out
        self.room = 0  # while swapping in: the most it may have on the GPU (0: no bound)
        self.bound = 0  # holding: the most it may have without asking again (0: its limit)
        self.grows = 0  # allocations that asked the node for more than the bound
        # Prefetch (before the grant): the latest ask's room and number, the last ask it
        # is done with, and whether its swap-in runs now.
        self.prefetch_room = 0
        self.prefetch_seq = 0
        self.prefetch_done = 0
        self.prefetching = False
        self.resume = False  # a grant for the lease a reconnect hello claimed is due
        self.swap_gen = -1  # the connection whose grant the swap-in follows
        self.msgs = Messages(lambda: self.backend.figures())  # numbers asks, keeps what was told
        self.depth = 0  # threads inside gpu()
        self._mine = threading.local()  # n: the calling thread's gpu() blocks open
        self.implicit = False  # a burst opened by checkpoint() outside gpu()
        self.busy = 0  # threads inside working(): no release for idleness meanwhile
        self.said_loop = False  # a wait on an asyncio loop's thread was said
        self.bursts = 0
        self.grants = 0
        self.waits: list[float] = []
        self.swap_lock = threading.Lock()  # one swap at a time, whichever thread
        self._idle_thread: threading.Thread | None = None
        # Last, the state above in place: a backend may report from its own thread at once
        # (the torch backend's allocator watcher did, on a GPU, before it was assigned).
        self.link = link(self)
        self.made = False  # the backend is assigned: its figures may be read
        self.backend = backend(
            SwapHooks(
                self.report,
                self.check_access,
                self.wait_room,
                self.grow,
                self.checkpoint,
                lambda: self.holding,
            )
        )
        self.made = True

    # --- what the session's public methods do ---------------------------------------

    @property
    def holding(self) -> bool:
        return self.phase is Phase.HOLDING and self.link.state in LIVE

    def enter(self) -> None:
        """``gpu()``'s entry: join the burst, or wait for it to be granted."""
        self._not_forked()
        with self.cond:
            if not self.holding:  # a burst in progress goes on while the node is away
                self.usable()
            self.depth += 1
            try:
                self._hold(implicit=False)
            except BaseException:
                self.depth -= 1
                self.cond.notify_all()
                raise
            self.implicit = False
            self._mine.n = getattr(self._mine, "n", 0) + 1

    def exit(self) -> None:
        """``gpu()``'s exit: the last thread out releases."""
        if self.link.state is Link.FORKED:
            return
        with self.cond:
            self.depth -= 1
            self._mine.n = getattr(self._mine, "n", 1) - 1
            if self.depth == 0 and self.phase is Phase.HOLDING:
                self._release(again=False)
            self.cond.notify_all()

    def checkpoint(self) -> None:
        """The slow path of a safe point: yield to a revoke, or open a burst."""
        self._not_forked()
        with self.cond:
            self.usable()
            if self.phase is Phase.HOLDING and self.revoke is not None:
                # A grant that thawed this process after a freeze may already be in the
                # socket behind the revoke it answers: read it before yielding to that.
                self.link.catch_up()
                self.usable()
                if self.phase is Phase.HOLDING and self.revoke is not None:
                    self._yield()
            elif self.phase is not Phase.HOLDING:
                self._hold(implicit=self.depth == 0)

    def pause_work(self) -> bool:
        """Give the lease back for a while of CPU work inside a burst (torch.compile
        compiling inside a forward, where no safe point comes for seconds): released as
        at a burst's end (a revoke pending is answered, its swap-out done), so that the
        node need not escalate. True if it was given back: :meth:`resume_work` then asks
        again. Only a burst of the calling thread alone: an implicit one (``gpushare
        run``'s hooks), or ``gpu()`` blocks of this thread with no other thread inside
        one (that thread's GPU work would lose the lease under it)."""
        self._not_forked()
        with self.cond:
            mine = getattr(self._mine, "n", 0)
            if not (self.phase is Phase.HOLDING and self.depth == mine and (mine or self.implicit)):
                return False
            self.backend.synchronize()  # the GPU work queued is done before the lease goes
            self.implicit = False
            self._release(again=False)
            self.cond.notify_all()
            return True

    def resume_work(self) -> None:
        """After :meth:`pause_work`: the burst asks again, and waits to hold (swapped in);
        inside ``gpu()`` as that block's burst, else as an implicit one."""
        self._not_forked()
        with self.cond:
            self.usable()
            if self.phase is not Phase.HOLDING:
                self._hold(implicit=self.depth == 0)

    def begin_work(self) -> None:
        with self.cond:
            self.busy += 1

    def end_work(self) -> None:
        with self.cond:
            self.busy -= 1
            self.last_work = _now()
            self.cond.notify_all()

    def close(self) -> bool:
        """Release any lease and mark the link closed; False if it was closed already."""
        with self.cond:
            if self.link.state is Link.CLOSED:
                return False
            if self.phase is Phase.HOLDING and self.link.state is Link.CONNECTED:
                # The node frees the memory at the detach that follows: no swap-out.
                self.link.send(self.msgs.release())
            self.phase, self.grant, self.revoke, self.lease = Phase.IDLE, None, None, 0
            self.link.end(Link.CLOSED, "closed")
            self._update()
            self.cond.notify_all()
            return True

    def forked(self) -> None:
        """In a forked child, without the lock (see :meth:`Transport.forked`)."""
        self.link.forked()
        self.ready = False

    # --- states ---------------------------------------------------------------------

    def _update(self) -> None:
        self.ready = self.phase is Phase.HOLDING and self.revoke is None and self.link.state in LIVE

    def _not_forked(self) -> None:
        # Checked before taking the lock: in a forked child, a thread that no longer
        # exists may have held it.
        if self.link.state is Link.FORKED:
            raise GpushareError(
                f"this session belongs to process {self.pid}: call gpushare.attach() in the child"
            )

    def usable(self) -> None:
        """Raise unless the link can serve a burst; while the node is away, wait for it
        up to ``reconnect_timeout``."""
        while True:
            st = self.link.state
            if st is Link.CONNECTED:
                return
            if st is Link.FORKED:
                self._not_forked()
            if st is Link.CLOSED:
                raise GpushareError("session is closed")
            if st is Link.ENDED:
                if self.link.on_ended is not None:
                    self._park()
                raise DaemonUnavailableError(
                    f"the gpushare node ended this session: {self.link.reason}"
                )
            left = self.link.away_since + self.reconnect_timeout - _now()
            if left <= 0:
                raise DaemonUnavailableError(
                    f"the gpushare node has been away for {self.reconnect_timeout:g} s"
                    f" ({self.link.reason}); set GPUSHARE_RECONNECT_TIMEOUT to wait longer"
                )
            self.cond.wait(left)

    def _park(self) -> None:
        """The node ended the session and ``on_ended`` stops the program (``gpushare
        run``: SIGTERM, SIGKILL after 10 s): a thread that waits for the GPU, or reaches
        a safe point, stays here until the program ends. An error raised here went to
        the program, which logged or answered it (a server answered the request waiting
        for the lease with HTTP 500 and a traceback through gpushare's hooks, issue 28)."""
        while True:
            self.cond.wait()

    def _say_if_on_a_loop(self) -> None:
        """A wait for the lease on the thread of a running asyncio event loop stops the
        loop for as long (a server's other requests, its health checks, go unanswered):
        said once, with the fix. The wait cannot be moved off the loop from inside the
        synchronous call that waits."""
        if self.said_loop or "asyncio" not in sys.modules:
            return
        try:
            sys.modules["asyncio"].get_running_loop()
        except RuntimeError:
            return  # no loop runs in this thread
        self.said_loop = True
        sys.stderr.write(
            f"gpushare: session {self.link.session} waits for the GPU on the thread of a"
            " running asyncio event loop, which answers nothing meanwhile (a server's health"
            " checks fail): run the GPU work off the loop, 'await asyncio.to_thread(model,"
            " x)', or in a sync endpoint ('def', not 'async def') (said once)\n"
        )
        sys.stderr.flush()

    def _hold(self, implicit: bool) -> None:
        """Until this burst holds the lease: ask (IDLE), or wait for the thread that
        asks or yields."""
        while self.phase is not Phase.HOLDING:
            if self.phase is Phase.IDLE:
                self.implicit = implicit
                self._acquire()
                if implicit:
                    self._start_idle_thread()
            else:
                self.cond.wait()
                self.usable()

    def _yield(self, need: int = 0) -> None:
        """At a safe point, holding: give the lease back and ask again (answering a
        revoke; with ``need``, for room past the bound), then wait to hold again."""
        self.backend.synchronize()  # GPU work queued is done before the lease goes
        t0 = _now()
        self._release(again=True, need=need)
        self._await(t0)

    def _acquire(self) -> None:
        self.bursts += 1
        self.phase, self.grant = Phase.ACQUIRING, None
        t0 = _now()
        self.link.send(self.msgs.acquire())
        self._await(t0)

    def _await(self, t0: float) -> None:
        """ACQUIRING (or YIELDING to ask again) until HOLDING; withdraws if interrupted."""
        self._say_if_on_a_loop()
        try:
            while True:
                self.usable()  # may wait for a reconnect: look at the grant after it
                if self.grant is not None:
                    if self._swap_in():
                        break
                elif self.prefetch_seq > self.prefetch_done:
                    self._prefetch()
                else:
                    self.cond.wait()
        except BaseException:
            self._withdraw()
            raise
        self.waits.append(_now() - t0)
        self.grants += 1
        self.last_work = _now()
        self.cond.notify_all()

    def _swap_in(self) -> bool:
        """Take the grant: swap in, wait for room, hold (True); or, the node gone, ask
        the next one (False)."""
        g, self.grant = self.grant, None
        assert g is not None
        self.phase = Phase.SWAPPING_IN
        self.swap_gen = self.link.generation
        back = self.backend.swapped_bytes or self.backend.discarded_bytes
        if not (g.swap_in or back or self.room):
            self.phase = Phase.HOLDING  # nothing to move, no room to wait for: the fast way
            self._update()
            return True
        try:
            with self._unlocked(), self.swap_lock:
                if g.swap_in or back:
                    self._swap("in", 0)
                # Work may grow the session to its bound: not before the node has room.
                self.wait_room(self.bound or self.memory_limit)
        except NodeLost:
            self._ask_again()
            return False
        if self.link.state is not Link.CONNECTED or self.link.generation != self.swap_gen:
            self._ask_again()  # it went away as the swap-in ended
            return False
        self.phase = Phase.HOLDING
        self._update()
        return True

    def _prefetch(self) -> None:
        """Swap in ahead of the grant, within the node's room (the swap lock held, the
        condition not); then tell the node which ask this was done with."""
        gen = self.link.generation
        self.swap_gen, self.prefetching = gen, True
        before, t0, error = self.backend.resident_bytes, _now(), ""
        done = self.prefetch_seq  # all in, a grant, or a failure: done with every ask
        try:
            with self._unlocked(), self.swap_lock:
                self.backend.swap_in()
        except PrefetchPaused as e:
            done = e.seq
        except NodeLost:
            pass  # the next node hears the figures in the hello
        except SwapError as e:
            log.warning("prefetch swap-in failed: %s", e)
            error = str(e)
        finally:
            self.prefetching = False
        if self.link.generation != gen:
            return  # asked by a node that went away: the new one numbers its own asks
        self.prefetch_done = max(self.prefetch_done, done)
        if self.link.state is Link.CONNECTED:
            moved = max(0, self.backend.resident_bytes - before)
            self.link.send(self.msgs.swap_done("in", moved, _now() - t0, error, prefetch=done))

    def _ask_again(self) -> None:
        """A swap-in stopped because the node that granted it went away: re-register
        what the session has and ask again; if still away, the reconnect asks."""
        self.phase, self.lease, self.revoke, self.room = Phase.ACQUIRING, 0, None, 0
        if self.link.state is Link.CONNECTED:
            if self.msgs.changed():
                self.link.send(self.msgs.report())
            self.link.send(self.msgs.acquire())
        self._update()

    def _withdraw(self) -> None:
        # Interrupted while asking (Ctrl-C, an error): withdraw from the queue, or give
        # back a grant that came meanwhile; a grant arriving later is never taken.
        if self.phase in (Phase.ACQUIRING, Phase.SWAPPING_IN, Phase.YIELDING):
            self.phase, self.grant, self.revoke, self.lease, self.room = (
                Phase.IDLE,
                None,
                None,
                0,
                0,
            )
            self.rejoin = False
            self.link.send(self.msgs.release())
            self._update()
            self.cond.notify_all()

    def _release(self, again: bool, need: int = 0, idle_s: float = 0.0) -> None:
        """HOLDING -> IDLE (burst end) or -> ACQUIRING (``again``: yield), by YIELDING
        when the revoke asked for a swap-out, done after the release so the next holder
        swaps in meanwhile."""
        rev, self.revoke = self.revoke, None
        swap_out = rev.swap_out if rev is not None and rev.lease == self.lease else 0
        if swap_out:
            self.backend.synchronize()  # the GPU work is done before the lease goes
        after = Phase.ACQUIRING if again else Phase.IDLE
        self.phase = Phase.YIELDING if swap_out else after
        self.lease, self.room, self.bound, self.grant, self.rejoin = 0, 0, 0, None, again
        self._update()
        self.link.send(
            self.msgs.release(again=again, swapping_out=swap_out, need=need, idle_s=idle_s)
        )
        if swap_out:
            try:
                with self._unlocked(), self.swap_lock:
                    self._swap("out", swap_out)
            except SwapError as e:
                log.error("swap-out asked by the revoke failed: %s", e)
            finally:
                self.phase = after
                self._update()
                self.cond.notify_all()

    @contextlib.contextmanager
    def _unlocked(self) -> Iterator[None]:
        self.cond.release()
        try:
            yield
        finally:
            self.cond.acquire()

    def _start_idle_thread(self) -> None:
        if self._idle_thread is None:
            self._idle_thread = threading.Thread(
                target=self._idle_loop, name="gpushare-idle", daemon=True
            )
            self._idle_thread.start()
        else:
            self.cond.notify_all()

    def _idle_loop(self) -> None:
        # Ends implicit bursts after idle_release seconds without a checkpoint (a
        # server's grant may say less: Grant.idle_release_s).
        with self.cond:
            while self.link.state in LIVE:
                if not (
                    self.implicit
                    and self.phase is Phase.HOLDING
                    and self.depth == 0
                    and not self.busy
                ):
                    self.cond.wait()
                    continue
                idle = _now() - self.last_work
                if idle >= self.burst_idle_s:
                    self.implicit = False
                    with contextlib.suppress(GpushareError, OSError):
                        self._release(again=False, idle_s=idle)  # (its idle, not work)
                else:
                    self.cond.wait(self.burst_idle_s - idle)

    # --- the backend's hooks --------------------------------------------------------

    def check_access(self) -> None:
        if not self.holding:
            raise GpushareError(
                "GPU memory used outside a lease: do GPU work inside 'with session.gpu():'"
            )

    def wait_room(self, resident: int) -> None:
        """Before each piece of a swap-in (the swapping thread, unlocked): the node that
        granted it is still there, and has room for ``resident`` bytes."""
        with self.cond:
            while True:
                if self.link.state is not Link.CONNECTED or self.link.generation != self.swap_gen:
                    raise NodeLost(
                        "the gpushare node went away during this session's swap-in:"
                        " it stops here and asks again"
                    )
                if self.prefetching:  # no waiting here: the grant, or more room, may come
                    if self.grant is not None or resident > self.prefetch_room:
                        raise PrefetchPaused(self.prefetch_seq)
                    return
                if not self.room or resident <= self.room:
                    return
                self.cond.wait()

    def grow(self, resident: int) -> None:
        """Before an allocation (the allocating thread, unlocked): ``resident`` bytes in
        all are more than the grant's bound? Then yield, asking again with that need
        (the rest of the quantum ahead of the queue), and hold again once the node has
        room: the allocation waits, as a burst's start does, and never fails for want of
        memory the limit allows."""
        with self.cond:
            while self.bound and resident > self.bound and self.phase is Phase.HOLDING:
                self.usable()
                self.grows += 1
                self._yield(need=resident)

    def report(self) -> None:
        # A swap-in's progress is not the node's concern: a holder counts at its limit
        # (or its room), a prefetching session at its room, and the SwapDone carries the
        # figures. Untold, the node is not kept busy with them during a switch.
        # Nor is a report while the backend is being made: the first release or grant
        # tells its figures.
        if self.phase is Phase.SWAPPING_IN or self.prefetching or not self.made:
            return
        self.link.send(self.msgs.report())

    def _swap(self, direction: Literal["in", "out"], nbytes: int) -> None:
        """One swap (swap lock held, condition not), told to the node that asked."""
        gen = self.link.generation
        b = self.backend
        try:
            r = b.swap_in() if direction == "in" else b.swap_out(nbytes)
        except NodeLost:
            raise  # the node that asked is gone; the next hears the figures
        except SwapError as e:
            self.link.send(self.msgs.swap_done(direction, 0, 0.0, str(e)))
            raise
        if self.link.generation != gen:  # asked by a node that went away since
            self.link.send(self.msgs.report())
            return
        self.link.send(self.msgs.swap_done(direction, r.bytes, r.seconds))

    def on_message(self, msg: p.Message) -> None:
        if isinstance(msg, p.SwapOut):
            self._on_swap_out(msg)
            return
        with self.cond:
            if isinstance(msg, p.Grant):
                self._on_grant(msg)
            elif isinstance(msg, p.Room):
                self._set_room(msg.room)
            elif isinstance(msg, p.Prefetch):
                self._on_prefetch(msg)
            elif isinstance(msg, p.Limits):  # a process of its family joined or left
                self.memory_limit = msg.memory_limit
                self.memory_request = msg.memory_request or msg.memory_limit
                self.backend.set_limit(msg.memory_limit)
            elif isinstance(msg, p.Revoke):
                if msg.lease and msg.lease == self.lease:  # else: for a lease gone already
                    self.revoke = msg
                    self.resume = False  # a lease claimed back and refused: yield it
            else:
                log.debug("ignored %s from the node", type(msg).__name__)
            self._update()
            self.cond.notify_all()

    def _on_grant(self, g: p.Grant) -> None:
        if g.resume:
            # The lease a hello claimed, given back. If the burst ended since, the release
            # sent then gives it back.
            if self.resume and self.phase is Phase.HOLDING:
                self.lease, self.token, self.revoke = g.lease, g.token, None
            self.resume = False
            return
        if g.ask and g.ask < self.msgs.asks:  # it answers an ask withdrawn since: not ours
            log.debug(
                "grant %d answers ask %d, not ask %d: not taken", g.lease, g.ask, self.msgs.asks
            )
            return
        if self.phase is Phase.HOLDING:  # thawed after a freeze: a new lease, same burst
            self.lease, self.token, self.revoke, self.bound = g.lease, g.token, None, g.bound
        elif self.grant is None and (
            self.phase is Phase.ACQUIRING or (self.phase is Phase.YIELDING and self.rejoin)
        ):
            self.grant, self.lease, self.token, self.bound = g, g.lease, g.token, g.bound
            self.burst_idle_s = g.idle_release_s or self.idle_release_s
            self._set_room(g.room)
        else:
            log.debug("grant %d not asked for (crossed a release): not taken", g.lease)

    def _on_prefetch(self, m: p.Prefetch) -> None:
        waiting = self.phase is Phase.ACQUIRING or (self.phase is Phase.YIELDING and self.rejoin)
        if waiting and self.grant is None and m.seq > self.prefetch_seq:
            self.prefetch_room, self.prefetch_seq = m.room, m.seq
        else:  # it crossed a grant or a withdrawal: the node counts it no longer
            log.debug("prefetch %d not taken (%s)", m.seq, self.phase.value)

    def _set_room(self, room: int) -> None:
        # its bound (its limit): no bound but that
        self.room = room if room < (self.bound or self.memory_limit) else 0

    def _on_swap_out(self, msg: p.SwapOut) -> None:
        # On the reader thread. Only memory of a session with no grant: its threads
        # cannot touch it (check_access), and no grant comes while this thread swaps.
        with self.cond:
            granted = self.phase in (Phase.HOLDING, Phase.SWAPPING_IN) or self.grant is not None
            if granted:  # a holder's memory is not for taking: the node plans anew
                self.link.send(self.msgs.swap_done("out", 0, 0.0, "session holds the GPU"))
                return
        with self.swap_lock, contextlib.suppress(SwapError):
            self._swap("out", msg.bytes)

    # --- the transport's peer (condition held) --------------------------------------

    def on_link_change(self) -> None:
        # The node that granted or revoked is gone: its revoke is moot (a burst goes on
        # while it is away), and a grant not taken yet is not the next node's.
        self.revoke = None
        if self.grant is not None:
            self.grant, self.lease = None, 0
        self.prefetch_room = self.prefetch_seq = self.prefetch_done = 0
        self._update()

    def resume_hello(self, hello: p.Hello) -> p.Hello:
        figures = self.backend.figures()
        return msgspec.structs.replace(
            hello,
            memory_limit=self.memory_limit,
            memory_request=self.memory_request,  # filled in, as the node told it (issue 37)
            weight=self.weight,
            gpu=self.gpu,
            resident=figures[0],
            swapped=figures[1],
            discarded=figures[2],
            holding=self.phase is Phase.HOLDING,
            # who it was, and the lease it holds with its token: the node checks them
            session=self.link.session,
            lease=self.lease if self.phase is Phase.HOLDING else 0,
            token=self.token if self.phase is Phase.HOLDING else "",
        )

    def on_reconnected(self, hello: p.Hello) -> None:
        """Tell a new node what changed since ``hello`` and what this session asks."""
        self.resume, self.revoke, self.room = hello.holding, None, 0
        self.lease = hello.lease if hello.holding else 0  # a revoke for it means: yield
        self.msgs.heard(hello)
        if hello.holding and self.phase is not Phase.HOLDING:
            # The burst ended after the hello: give back the lease the node grants for it.
            self.link.send(self.msgs.release())
        elif self.msgs.changed():  # memory moved after the hello
            self.link.send(self.msgs.report())
        if self.phase is Phase.ACQUIRING or (self.phase is Phase.YIELDING and self.rejoin):
            self.grant = None
            self.link.send(self.msgs.acquire())
        self._update()

"""The wire protocol between workloads, administrators and the node daemon.

Every message is one frame: a 4-byte big-endian length, then a msgpack body holding a
tagged msgspec struct. This module is the only place that knows the codec, so swapping
it means touching one file. Frames larger than :data:`MAX_FRAME` are refused before
they are read, so a hostile peer cannot make the daemon allocate without bound.
"""

from __future__ import annotations

import struct
from typing import Any, Literal

import msgspec

from gpushare.settings import Escalation, Mode, Policy
from gpushare.status import NodeStatus

PROTOCOL_VERSION = 1
MAX_FRAME = 1 << 20  # 1 MiB: status of hundreds of sessions fits, garbage does not
_HEADER = struct.Struct(">I")
HEADER_SIZE = _HEADER.size


class ProtocolError(Exception):
    """A frame or message that breaks the protocol; the connection that sent it is closed."""


class _Msg(msgspec.Struct, tag_field="t", forbid_unknown_fields=False, omit_defaults=True):
    pass


# --- workload -> daemon -------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    """First message on every connection: who this is and what it needs."""

    version: int
    name: str = ""
    memory_limit: int | None = None
    weight: float | None = None
    portion: float | None = None  # KAI's GPU_PORTION, when no memory limit was given
    # The memory request (what the node guarantees and packs by), sent whenever one was
    # asked (None: none asked, the node fills in the limit), and the limit as a portion
    # of the GPU (KAI's gpu-memory.portion.limit; with portion).
    memory_request: int | None = None
    portion_limit: float | None = None
    grows: bool = False  # it asks (a Release with a need) before it has more than its bound
    # Its pod's compute-sharing mode (KAI's gpu-compute-sharing-mode): "time-slicing",
    # "sm-sharing", or "" (the GPU's mode).
    sharing: str = ""
    compute_limit: float | None = None  # the most of the GPU's time it may take (0, 1]
    gpu: int | None = None
    gpu_uuid: str = ""  # from NVIDIA_VISIBLE_DEVICES; the node maps it to its index
    backend: str = "sim"
    pod: str = ""
    namespace: str = ""
    container: str = ""
    pod_uid: str = ""  # claimed; checked against the kernel's cgroup view
    # A workload that outlived a node restart re-registers what it has: its memory, the
    # session id it had, and mid-burst the lease it holds with the token it came with.
    resident: int = 0
    swapped: int = 0
    discarded: int = 0  # discardable memory it dropped (rebuilt at its next grant)
    holding: bool = False
    session: int = 0
    lease: int = 0
    token: str = ""
    fills: bool = False  # it swaps in within a Room, so its switches may overlap
    prefetch: bool = False  # it swaps in ahead of its grant when a Prefetch says so
    # The distributed job this process is a rank of (client/launchers.py): its ranks on
    # a node are granted together. gang: a job id ("" for none); gang_size: its ranks
    # on this node; rank: this one's among them (-1: not known); world_size: its ranks
    # on all nodes (0: not known; more than gang_size: the job spans nodes).
    gang: str = ""
    gang_size: int = 0
    rank: int = -1
    world_size: int = 0
    # A process started by session ``family``'s program, joining it as a member (one
    # lease, its memory out of that session's limit: docs/scheduling.md "Families"); the
    # node checks that it descends from that session's process. 0: a session of its own.
    family: int = 0
    # The DRA ResourceClaim (its UID) whose share this is, from the CDI env gpushare's
    # DRA plugin wrote (GPUSHARE_CLAIM): the node attaches it only within that claim's
    # figures, as the plugin prepared it (docs/kubernetes.md "DRA").
    claim: str = ""
    # On a simulated GPU, how a CPU-run program's GPU memory is modelled in its sim
    # backend (client/modelled.py): "weights", "declared", or "" (none).
    resident_model: str = ""


class Acquire(_Msg, tag="acquire"):
    """A burst begins: the workload wants the GPU. ``ask`` numbers the session's asks
    (this and every ``Release`` with ``again``) from 1, so that a grant can name the ask
    it answers (0: not numbered, an older client)."""

    ask: int = 0


class Release(_Msg, tag="release"):
    """The burst ended (``again`` False) or the workload yielded after a revoke and wants
    the GPU again (``again`` True). Carries what it swapped out on the way (older
    clients), or what it swaps out now, after the release (``swapping_out``: reported by
    :class:`Report` as it goes and :class:`SwapDone` at the end)."""

    resident: int
    swapped: int
    again: bool = False
    # Bytes of discardable memory it dropped instead of swapping out (client.md): neither
    # on the GPU nor in host memory; it is made again, empty, at its next grant.
    discarded: int = 0
    swapped_out: int = 0
    seconds: float = 0.0
    swapping_out: int = 0
    ask: int = 0  # with ``again``: this ask's number (as Acquire's)
    # With ``again``, from a holder whose client grows: an allocation needs this many
    # bytes on the GPU, more than its grant's bound; it holds again when they fit.
    need: int = 0
    # A burst's end (not ``again``): seconds it held with no work at its end (an
    # implicit burst's idle release), not counted in its burst's length.
    idle_s: float = 0.0


class SwapDone(_Msg, tag="swap_done"):
    """A swap finished (or failed: ``error`` set, the session kept what it had)."""

    direction: Literal["in", "out"]
    bytes: int
    seconds: float
    resident: int
    swapped: int
    error: str = ""
    prefetch: int = 0  # a prefetch's swap-in: the last Prefetch (its seq) it is done with
    discarded: int = 0  # as Release's: dropped, not on the GPU nor in host memory


class Report(_Msg, tag="report"):
    """The workload's GPU memory changed (allocation, free)."""

    resident: int
    swapped: int
    discarded: int = 0


# --- daemon -> workload -------------------------------------------------------------


class Welcome(_Msg, tag="welcome"):
    session: int
    name: str
    gpu: int
    gpu_name: str
    simulated: bool
    memory_limit: int
    weight: float
    idle_release_s: float
    # Filled in (its limit where it asked none); 0 only from a node older than issue 37,
    # which left it out for "the limit": read so.
    memory_request: int = 0
    sim_scale: int = 1024
    sim_bandwidth: float = 55e9
    sim_swap_failure_rate: float = 0.0
    gpu_uuid: str = ""  # the workload finds its CUDA device by it
    sim_link: str = ""  # the simulated GPU's shared link file (its timing model)
    tq_s: float = 0.0  # the GPU's TQ at attach (0: an older node did not say)


class Grant(_Msg, tag="grant"):
    """The lease: GPU work may be issued. ``swap_in`` bytes must come back first."""

    lease: int
    swap_in: int
    quantum_s: float
    shared: bool = False
    room: int = 0  # >0: have at most this many bytes on the GPU until a Room says more
    token: str = ""  # the node's signature of this lease: shown to claim it back after a restart
    resume: bool = False  # the lease a hello claimed (holding), given back
    # The last ask the node had read when it granted: a grant for an ask the client has
    # since withdrawn (it crossed the release) names an older one, and is not taken.
    ask: int = 0
    # >0: the most it may have on the GPU while it holds this lease without asking again
    # (a Release with a need); 0: its limit. Lent in mode auto to a client that grows.
    bound: int = 0
    # >0: end this lease's implicit bursts this long after their last safe point (a
    # server's requests: the GPU goes back soon after each); 0: the welcome's.
    idle_release_s: float = 0.0


class Limits(_Msg, tag="limits"):
    """The session's memory limit and request changed: a process of its family joined
    (taking its part of them) or left (giving it back). Hold to these from now on."""

    memory_limit: int
    memory_request: int = 0  # filled in, as the welcome's (0: an older node's "the limit")


class Room(_Msg, tag="room"):
    """A filling holder may now have ``room`` bytes on the GPU (its limit: no bound)."""

    room: int


class Prefetch(_Msg, tag="prefetch"):
    """The lease is another's, and this session is next: swap in now, before the grant,
    up to ``room`` resident bytes (swap-in only: no GPU work). A later Prefetch may give
    more room; :class:`SwapDone` with ``prefetch`` set to the last ``seq`` acted on says
    it is done with every ask up to it (room used up, all in, or a grant came)."""

    room: int
    seq: int


class Revoke(_Msg, tag="revoke"):
    """The quantum ended and someone waits: stop at the next safe point, swap out
    ``swap_out`` bytes and answer with :class:`Release`."""

    lease: int
    swap_out: int
    grace_s: float


class SwapOut(_Msg, tag="swap_out"):
    """Make room: move this many bytes of an idle or waiting session to host memory."""

    bytes: int


class Error(_Msg, tag="error"):
    code: str
    message: str


# --- administration (admin socket only) ---------------------------------------------


class StatusRequest(_Msg, tag="status"):
    pass


class StatusReply(_Msg, tag="status_reply"):
    status: NodeStatus


class SetConfig(_Msg, tag="set_config"):
    """Change settings live (all GPUs, or ``gpu``); ``persist``: write them down too.
    A value outside its literal is a malformed message; a TQ is checked by the node."""

    gpu: int | None = None
    tq_s: float | None = None
    mode: Mode | None = None
    policy: Policy | None = None
    escalation: Escalation | None = None
    persist: bool = False


class GpuConfig(msgspec.Struct, kw_only=True):
    """One GPU's settings in force, as a :class:`ConfigReply` gives them."""

    index: int
    tq_s: float
    mode: Mode
    policy: Policy
    escalation: Escalation


class ConfigReply(_Msg, tag="config_reply"):
    gpus: list[GpuConfig]
    persisted_to: str = ""


class EndSession(_Msg, tag="end_session"):
    """Administration: end a session (its lease and memory are freed): at once, or after
    ``grace_s`` seconds in which it is told (:class:`Ending`) and keeps its turns."""

    session: int
    reason: str = "ended by an administrator"
    grace_s: float = 0.0


class PrepareClaim(_Msg, tag="prepare_claim"):
    """Administration (gpushare's DRA plugin, at NodePrepareResources): a ResourceClaim
    allocated a share of this node's GPU ``gpu`` and prepared for ``pods``. Sessions that
    name it attach within its figures: its memory request (what the scheduler allocated)
    its limit (0: none given) and its weight (0: none). Sent again the same, it changes
    nothing."""

    uid: str
    namespace: str = ""
    name: str = ""
    gpu: int = 0
    pods: list[str] = msgspec.field(default_factory=list)  # its status.reservedFor
    memory_request: int = 0
    memory_limit: int = 0
    weight: float = 0.0  # its GPUShareClaimParameters.weight; 0: none given
    compute_limit: float = 0.0  # its computeLimit, in (0, 1]; 0: none given


class UnprepareClaim(_Msg, tag="unprepare_claim"):
    """Administration (the DRA plugin, at NodeUnprepareResources): the claim is done
    with; its sessions end as :class:`EndSession` ends one (told, ``grace_s`` of turns),
    and a new session naming it is refused. A claim not prepared here: nothing to do."""

    uid: str
    reason: str = "its ResourceClaim was unprepared"
    grace_s: float = 0.0


class Ending(_Msg, tag="ending"):
    """To a workload: the node ends this session in ``grace_s`` seconds (``ctl end``).
    Its turns go on meanwhile, so a server's shutdown can answer what is in flight."""

    reason: str
    grace_s: float


class Done(_Msg, tag="done"):
    message: str


class EventsRequest(_Msg, tag="events"):
    follow: bool = False
    since_s: float | None = None
    session: int | None = None


class EventMsg(_Msg, tag="event"):
    event: dict[str, Any]


class EventsEnd(_Msg, tag="events_end"):
    """End of the backlog; with ``follow`` live events come after it."""


Message = (
    Hello
    | Acquire
    | Release
    | SwapDone
    | Report
    | Welcome
    | Grant
    | Limits
    | Room
    | Prefetch
    | Revoke
    | SwapOut
    | Ending
    | Error
    | StatusRequest
    | StatusReply
    | SetConfig
    | ConfigReply
    | EndSession
    | PrepareClaim
    | UnprepareClaim
    | Done
    | EventsRequest
    | EventMsg
    | EventsEnd
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One whole frame, header included."""
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """Body length from a frame header; refuses oversized frames before reading them."""
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")
    return int(n)


def decode(body: bytes | memoryview) -> Message:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as e:  # ValidationError is a subclass
        raise ProtocolError(f"malformed message: {e}") from None


class FrameBuffer:
    """Incremental frame splitter for blocking sockets (the client's reader thread)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= HEADER_SIZE:
            n = frame_length(bytes(self._buf[:HEADER_SIZE]))
            if len(self._buf) < HEADER_SIZE + n:
                break
            out.append(decode(bytes(self._buf[HEADER_SIZE : HEADER_SIZE + n])))
            del self._buf[: HEADER_SIZE + n]
        return out

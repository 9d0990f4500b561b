"""The bounds every field of a hello keeps, checked before anything of it is used: names
as Kubernetes bounds them and without characters that would not show as themselves,
weights and portions finite and in range, gangs and ranks within their sizes. A hello
past one is refused with a message naming the field (:func:`check_hello`).
"""

from __future__ import annotations

import re
import unicodedata

from gpushare import protocol as p
from gpushare.node.guard import Refused
from gpushare.settings import RESIDENT_MODELS, SHARING_MODES
from gpushare.units import is_fraction

# The longest each text of a hello may be: Kubernetes' bounds for names (a DNS
# subdomain, 253) and labels (63); a UUID; a job id as long as a name.
TEXT_BOUNDS = {
    "name": 253,
    "pod": 253,
    "namespace": 63,
    "container": 63,
    "pod_uid": 36,
    "gpu_uuid": 64,
    "backend": 32,
    "gang": 253,
    "token": 64,
    "claim": 36,  # a Kubernetes UID
}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # would rewrite an administrator's terminal
# Unicode's control, format (bidi overrides and isolates, zero-width characters), line and
# paragraph separators, surrogates and private use: each would show a name other than it
# is (U+202E writes the rest of a line backwards) in ctl status, top, logs and events.
_UNSEEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co"})


def unsafe_text(text: str) -> str:
    """The first character of ``text`` that would not show as itself ('' when none)."""
    if text.isascii():
        m = _CONTROL.search(text)
        return m.group() if m else ""
    return next((c for c in text if unicodedata.category(c) in _UNSEEN), "")


MAX_GANG = 4096
MAX_WORLD = 1 << 20  # ranks of a job on all nodes


def check_hello(h: p.Hello) -> None:
    """Every bound a hello's fields must keep, or :class:`Refused` naming the field."""
    for name, most in TEXT_BOUNDS.items():
        text: str = getattr(h, name)
        if len(text) > most:
            raise Refused(
                "attach", f"hello: {name} is {len(text)} characters long, the most is {most}"
            )
        bad = unsafe_text(text)
        if bad:
            raise Refused(
                "attach",
                f"hello: {name} holds control characters (U+{ord(bad):04X},"
                f" {unicodedata.name(bad, 'a control character')}): name it with printable"
                " characters only",
            )
    _check_words(h)
    if h.portion is not None and not is_fraction(h.portion):
        raise Refused(
            "attach",
            f"hello: portion must be a fraction in (0, 1] (KAI's GPU_PORTION), not {h.portion}",
        )
    pl = h.portion_limit
    if pl is not None and not (h.portion is not None and is_fraction(pl, low=h.portion)):
        raise Refused(
            "attach",
            "hello: portion_limit must be a fraction in [portion, 1] beside a portion"
            f" (KAI's gpu-memory.portion.limit), not {pl}",
        )
    if not 0 <= h.gang_size <= MAX_GANG or not -1 <= h.rank < max(h.gang_size, 1):
        raise Refused(
            "attach",
            f"hello: gang_size must be in [0, {MAX_GANG}] and rank in [-1, gang_size),"
            f" not {h.gang_size} and {h.rank}",
        )
    if not 0 <= h.world_size <= MAX_WORLD:
        raise Refused(
            "attach", f"hello: world_size must be in [0, {MAX_WORLD}], not {h.world_size}"
        )
    for name in ("session", "lease"):
        if not 0 <= getattr(h, name) < 2**63:
            raise Refused("attach", f"hello: {name} must be a number >= 0")


def _check_words(h: p.Hello) -> None:
    if h.resident_model and h.resident_model not in RESIDENT_MODELS:
        raise Refused(
            "attach",
            f"hello: resident_model must be one of {', '.join(RESIDENT_MODELS)} or empty,"
            f" not {unsafe_text(h.resident_model)!r} (gpushare run --sim-resident)",
        )
    if h.sharing and h.sharing not in SHARING_MODES:
        raise Refused(
            "attach",
            f"hello: sharing must be one of {', '.join(SHARING_MODES)} (KAI's"
            f" gpu-compute-sharing-mode) or empty, not {h.sharing!r}",
        )

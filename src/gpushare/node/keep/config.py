"""The node's configuration: a config file, a state file, command-line flags (TOML).

Precedence, lowest first: built-in defaults, the config file (``--config``: in
Kubernetes the mounted ConfigMap, watched and applied live), the state file (``--state``:
what ``ctl ... --persist`` wrote on this node; without ``--state``, ``--persist`` writes
the config file itself), then command-line flags. Within the merged result a
``[gpu.N]`` table overrides TQ, mode, policy or escalation for GPU N.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from gpushare.settings import (
    ESCALATIONS,
    KEYS,
    MODES,
    POLICIES,
    RANGES,
    Change,
    Escalation,
    Mode,
    Policy,
    SettingsError,
    validate,
)
from gpushare.settings import (
    check as check_value,
)
from gpushare.units import parse_duration, parse_size

log = logging.getLogger("gpushare.node.config")


class GpuOverride(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    tq: float | None = None
    mode: Mode | None = None
    policy: Policy | None = None
    escalation: Escalation | None = None


class NodeConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tq: float = 30.0
    mode: Mode = "auto"
    policy: Policy = "equal"
    grace: float = 5.0
    escalation: Escalation = "log"
    idle_release: float = 0.5
    overlap: bool = True  # a switch's swap-in runs while the swap-out frees memory
    prefetch: bool = True  # the next holder swaps in during the quantum, where memory allows
    turn: float = 1.0  # the longest interactive turn, seconds (0: no turns)
    turn_share: float = 0.25  # turn credit earned per idle second (docs/scheduling.md)
    reserve: str | int = 0
    # NVML counts a process's CUDA context and libraries' workspaces beside the memory
    # its session accounts for: a process is over its limit only past this much more.
    nvml_allowance: str | int = "1GiB"
    socket: str = "/run/gpushare/gpushare.sock"
    admin_socket: str = "/run/gpushare/admin.sock"
    event_log: str = ""
    proc_root: str = "/proc"
    kubernetes: bool = False  # resolve pod UIDs to names through the Kubernetes API
    # A workload may choose its compute-sharing mode (hello.sharing) against its GPU's
    # mode. Off, a GPU's mode is its administrator's: only a pod's annotation read
    # through the API (--kubernetes) puts a session in another.
    workload_sharing: bool = False
    node_name: str = ""  # this node's name in Kubernetes (default: $NODE_NAME, hostname)
    admin_group: str = ""  # a group whose members may administer (socket mode 0660)
    max_sessions_per_uid: int = 64
    max_messages_per_s: float = 2000.0  # per connection, bursts of twice that allowed
    # all the connections of one user together (a pod, by its UID; else a uid)
    max_messages_per_s_per_user: float = 8000.0
    hello_timeout: float = 10.0
    max_pending_per_uid: int = 64  # connections of one uid that have not said hello yet
    max_pending: int = 512  # the same, all uids together
    # After a restart, grant nothing until the sessions on record are back, at most this
    # long (seconds); the records are kept in recovery_dir (default: the admin socket's).
    recovery_window: float = 10.0
    recovery_dir: str = ""
    metrics_port: int = 9423  # 0: no exporter
    metrics_address: str = "0.0.0.0"
    sim_gpus: int = 0
    sim_memory: str | int = "80GiB"
    sim_bandwidth: float = 55e9
    sim_scale: int = 1024
    sim_swap_failure_rate: float = 0.0  # each swap-out fails with this probability
    gpu: dict[str, GpuOverride] = {}


class ConfigError(ValueError):
    pass


# What a key of each type takes, in our words, and how to write it in TOML.
_TAKES = {
    "float": "a number",
    "int": "a whole number",
    "bool": "true or false",
    "str": "a text in quotes",
    "int | str": 'a size in quotes (like "2GiB") or a number of bytes',
    "object": "a table",
}
_EXAMPLES = {
    "float": "{key} = 2.5",
    "int": "{key} = 3",
    "bool": "{key} = true",
    "str": '{key} = "..."',
    "int | str": '{key} = "2GiB"',
}
_GOT = {"str": "a text", "int": "a whole number", "float": "a number", "bool": "true or false",
        "array": "a list", "object": "a table", "null": "nothing"}  # fmt: skip
_MSGSPEC = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<at>[^`]*)`)?$")
DURATION_KEYS = tuple(k for k, r in RANGES.items() if r.unit == "s")


def _durations(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with each duration written as text (``tq = "30s"``, as ``--tq 30s`` and
    ``ctl tq 30s`` take it) read into seconds; the text of ``raw`` is left as it is."""

    def read(where: str, key: str, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse_duration(value)
        except ValueError as e:
            raise SettingsError(f"{where}{key}: {e}") from None

    out = {k: read("", k, v) if k in DURATION_KEYS else v for k, v in raw.items()}
    tables = raw.get("gpu")
    if isinstance(tables, dict):
        out["gpu"] = {
            i: {k: read(f"[gpu.{i}] ", k, v) if k == "tq" else v for k, v in t.items()}
            if isinstance(t, dict)
            else t
            for i, t in tables.items()
        }
    return out


def _convert(raw: dict[str, Any]) -> NodeConfig:
    """``raw`` (a file's TOML, or layers merged) as a :class:`NodeConfig`, or
    :class:`SettingsError` in our words: the key, what it takes, how to write it."""
    raw = _durations(raw)
    try:
        return msgspec.convert(raw, NodeConfig)
    except msgspec.ValidationError as e:
        raise SettingsError(_explain(str(e), raw)) from None


def _explain(message: str, raw: dict[str, Any]) -> str:
    """msgspec's words (``Expected `float`, got `str` - at `$.tq` ``) as ours."""
    m = _MSGSPEC.match(message)
    what, at = (m.group("what"), m.group("at") or "") if m else (message, "")
    table, key, table_raw = "", at.lstrip("."), {}
    if at.startswith(".gpu[...]"):  # msgspec does not say which table: find it
        key = at[len(".gpu[...]") :].lstrip(".")
        for index, t in (raw.get("gpu") or {}).items():
            try:
                msgspec.convert(t, GpuOverride)
            except msgspec.ValidationError:
                table, table_raw = f"[gpu.{index}] ", t
                break
    unknown = re.match(r"Object contains unknown field `(.*)`", what)
    if unknown:
        if table or at.startswith(".gpu"):
            return (
                f"{table}unknown key {unknown.group(1)!r}: a [gpu.N] table takes tq, mode,"
                " policy and escalation"
            )
        keys = ", ".join(k for k in NodeConfig.__struct_fields__ if k != "gpu")
        return (
            f"unknown key {unknown.group(1)!r}: check its spelling (the keys: {keys};"
            " per GPU in [gpu.N] tables)"
        )
    enum = re.match(r"Invalid enum value (.*)", what)
    if enum:
        choices = {"mode": MODES, "policy": POLICIES, "escalation": ESCALATIONS}.get(key, ())
        return (
            f"{table}{key} = {enum.group(1)} is not a choice: write one of"
            f" {', '.join(repr(c) for c in choices)} (in quotes)"
        )
    typed = re.match(r"Expected `(?P<want>[^`]*)`, got `(?P<got>[^`]*)`", what)
    if typed and key:
        return _explain_type(typed, table, key, table_raw if table else raw)
    return f"{table}{key}: {what}" if key else what


def _explain_type(typed: re.Match[str], table: str, key: str, raw: dict[str, Any]) -> str:
    """A value of the wrong type (msgspec's `want` and `got`) at ``key`` of ``raw``."""
    if key == "gpu":
        return "gpu must be tables, one per GPU: [gpu.0] then its keys"
    want = typed.group("want").removesuffix(" | null")
    value = raw.get(key)
    got = (
        json.dumps(value)
        if isinstance(value, str | int | float | bool)
        else _GOT.get(typed.group("got"), typed.group("got"))
    )
    if key in DURATION_KEYS:
        return (
            f"{table}{key} takes a number of seconds or a duration in quotes, not {got}:"
            f' write it like {key} = 30 or {key} = "30s"'
        )
    example = _EXAMPLES.get(want, "").format(key=key)
    return f"{table}{key} takes {_TAKES.get(want, want)}, not {got}" + (
        f": write it like {example}" if example else ""
    )


def read_raw(path: str | os.PathLike[str] | None, *, named: bool = False) -> dict[str, Any]:
    """A file's TOML as a dict; a path that does not exist yet gives ``{}`` (and, for a
    file the user ``named``, a warning: a mistyped --config would pass unseen)."""
    if not path:
        return {}
    if not Path(path).exists():
        if named:
            log.warning(
                "config file %s does not exist: the defaults and the flags apply"
                " (check the path given to --config)",
                path,
            )
        return {}
    try:
        raw = tomllib.loads(read_regular(path).decode())
        check(_convert(raw))  # each file must be valid on its own
        return _durations(raw)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except SettingsError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None


READ_MOST = 1 << 20  # a config file bigger than this is not one


class NotRegular(OSError):
    """A config path that is not a regular file (a FIFO, a device, a directory)."""


def read_regular(path: str | os.PathLike[str]) -> bytes:
    """The whole of a config file, read only if it is a regular file: opened without
    blocking (a FIFO there would stop the node until someone wrote to it) and checked
    through its descriptor; or :class:`OSError` (:class:`NotRegular` naming what it is).
    Symlinks are followed: a ConfigMap's files are symlinks to its current data."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(
                f"{path} is not a regular file (mode {stat.filemode(st.st_mode)}): the node"
                " reads its configuration only from a regular file; put one there"
            )
        if st.st_size > READ_MOST:
            raise OSError(f"{path} is {st.st_size} bytes, more than {READ_MOST}")
        chunks = []
        while data := os.read(fd, READ_MOST + 1):
            chunks.append(data)
            if sum(map(len, chunks)) > READ_MOST:
                raise OSError(f"{path} is more than {READ_MOST} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def merge(*layers: dict[str, Any]) -> NodeConfig:
    """Later layers win; ``[gpu.N]`` tables merge key by key."""
    out: dict[str, Any] = {}
    gpu: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for k, v in layer.items():
            if k == "gpu":
                for idx, table in v.items():
                    gpu.setdefault(str(idx), {}).update(table)
            elif v is not None:
                out[k] = v
    if gpu:
        out["gpu"] = gpu
    try:
        return check(_convert(out))
    except SettingsError as e:
        raise ConfigError(f"configuration: {e}") from None


SIZE_KEYS = ("reserve", "nvml_allowance", "sim_memory")


def check(cfg: NodeConfig) -> NodeConfig:
    """Every setting checked as it is on the command line and over the wire
    (gpushare.settings: the GPU settings as every live change is, each numeric key
    against its range); the literals were checked by their types already."""
    validate(**{field: getattr(cfg, key) for field, key in KEYS.items()})
    for key in RANGES:
        check_value(key, getattr(cfg, key))
    for key in SIZE_KEYS:
        try:
            size = parse_size(getattr(cfg, key))
        except ValueError as e:
            raise SettingsError(f"{key}: {e}") from None
        if key == "sim_memory" and size <= 0:
            raise SettingsError("sim_memory must be a positive size, like 80GiB")
    for index, o in cfg.gpu.items():
        if not index.isdigit():
            raise SettingsError(f"[gpu.{index}]: a GPU table is named by its index, like [gpu.0]")
        try:
            validate(**_overrides(o))
        except SettingsError as e:
            raise SettingsError(f"[gpu.{index}]: {e}") from None
    return cfg


def check_gpus(cfg: NodeConfig, count: int) -> None:
    """Each ``[gpu.N]`` table names a GPU of this node (``count`` of them), or
    :class:`ConfigError`: a table for a GPU the node does not have is a mistake, not a
    setting to ignore."""
    extra = sorted((k for k in cfg.gpu if int(k) >= count), key=int)
    if extra:
        raise ConfigError(
            f"[gpu.{extra[0]}]: this node has {count} GPU{'s' if count != 1 else ''}"
            f" (0..{count - 1}): remove the table or fix its index"
        )


def load(
    path: str | os.PathLike[str] | None,
    state: str | os.PathLike[str] | None = None,
    flags: dict[str, Any] | None = None,
) -> NodeConfig:
    """Defaults, then the config file, the state file and the flags."""
    return merge(read_raw(path, named=True), read_raw(state), flags or {})


def _overrides(o: GpuOverride | None) -> dict[str, object]:
    """The settings a ``[gpu.N]`` table sets (by their :class:`Change` keys)."""
    if o is None:
        return {}
    return {
        field: getattr(o, key)
        for field, key in KEYS.items()
        if key in GpuOverride.__struct_fields__ and getattr(o, key) is not None
    }


def settings_for(cfg: NodeConfig, index: int) -> Change:
    """Every live-changeable setting of GPU ``index`` (:data:`gpushare.settings.KEYS`:
    TQ, mode, policy, escalation, overlap, prefetch, idle_release, turn, turn_share),
    its ``[gpu.N]`` table applied: what its arbiter starts with, and what a changed
    config file is compared by."""
    values: dict[str, object] = {field: getattr(cfg, key) for field, key in KEYS.items()}
    values.update(_overrides(cfg.gpu.get(str(index))))
    return validate(**values)


def file_keys(change: Change) -> dict[str, Any]:
    """A change by the config file's keys (``tq_s`` is ``tq``...): what is persisted."""
    return {KEYS[field]: value for field, value in change.items()}


def persist(path: str | os.PathLike[str], gpu: int | None, change: Change) -> None:
    """Write ``change`` (TQ, mode, policy, escalation: a ``[gpu.N]`` table's keys) into
    the file, by the file's key names, atomically.

    For one GPU they go to its ``[gpu.N]`` table; for all, to the top level, and the
    same keys are dropped from every ``[gpu.N]`` table so that they apply everywhere.
    Other keys are kept (comments are not: the file is rewritten).
    """
    import tomli_w  # daemon-only dependency

    values = file_keys(change)
    p = Path(path)
    raw: dict[str, Any] = tomllib.loads(p.read_text()) if p.exists() else {}
    tables: dict[str, Any] = raw.setdefault("gpu", {})
    if gpu is None:
        raw.update(values)
        for t in tables.values():
            for k in values:
                t.pop(k, None)
    else:
        tables.setdefault(str(gpu), {}).update(values)
    raw["gpu"] = {k: v for k, v in tables.items() if v}
    if not raw["gpu"]:
        del raw["gpu"]
    try:  # never write a file the node could not read back
        check(_convert(raw))
    except SettingsError as e:
        raise ConfigError(f"not persisted: {e}") from None
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            tomli_w.dump(raw, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

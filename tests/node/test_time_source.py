"""One time source in the node: nothing in gpushare.node reads the time but the
SystemClock, and no timer is set on the event loop's own clock, so a node given a
ManualClock (and the virtual-time loop) is driven by it alone."""

from __future__ import annotations

import ast
from pathlib import Path

import gpushare.node

NODE = Path(gpushare.node.__file__).parent
CLOCK = NODE / "host" / "clock.py"
# Reading time: the time and datetime modules. Timers on the loop's own clock: call_at
# and loop.time() (relative delays, asyncio.sleep and call_later, are the clock's).
FORBIDDEN_MODULES = {"time", "datetime"}
FORBIDDEN_CALLS = {"call_at", "time"}


def offences(path: Path) -> list[str]:
    out = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Import):
            out += [f"{where} import {a.name}" for a in n.names if a.name in FORBIDDEN_MODULES]
        elif isinstance(n, ast.ImportFrom) and n.module in FORBIDDEN_MODULES:
            out.append(f"{where} from {n.module} import ...")
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in FORBIDDEN_CALLS
            and not (isinstance(n.func.value, ast.Name) and n.func.value.id == "self")
        ):
            out.append(f"{where} {ast.unparse(n.func)}()")
    return out


def test_only_the_system_clock_reads_the_time():
    modules = sorted(NODE.rglob("*.py"))
    assert len(modules) > 10 and CLOCK in modules
    found = [o for m in modules if m != CLOCK for o in offences(m)]
    assert found == [], "read the injected clock (self.clock) instead: " + ", ".join(found)
    assert offences(CLOCK)  # the check sees what it looks for


def test_the_check_catches_each_way_of_reading_the_time(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import time\nfrom datetime import datetime\n"
        "def f(loop):\n    loop.call_at(1.0, print)\n    return loop.time()\n"
    )
    assert len(offences(bad)) == 4

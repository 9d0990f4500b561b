"""torch.compile under ``gpushare run``: gpushare's hooks add no dynamo frame, graph or
graph break (they were traced into compiled code, and recompiled when a revoke came),
while a rival session forces revokes; a model compiled in place keeps its safe point."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support import sim

from .test_run import gs_run

pytest.importorskip("torch", reason="PyTorch is not installed")

COMPILED = textwrap.dedent("""
    import json, sys, time, torch
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    inplace = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    inplace.compile(backend="eager")  # compiled in place: Module.compile
    wrapped = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
                            backend="eager")
    x = torch.randn(8, 16)
    end, steps = time.monotonic() + float(sys.argv[1]), 0
    while time.monotonic() < end or steps < 5:
        (inplace(x).sum() + wrapped(x).sum()).backward()
        steps += 1
        time.sleep(0.01)
    try:
        from gpushare.client import runner
        s = runner.SESSION
    except ImportError:
        s = None
    print(json.dumps({
        "frames": counters["frames"]["total"],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "steps": steps,
        "grants": s.grants if s else None,
        "yields": s.bursts if s else None,
    }))
""")

RIVAL = textwrap.dedent("""
    import sys, time
    from gpushare.client import runner
    s = runner.SESSION
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        with s.gpu():
            time.sleep(0.05)
        time.sleep(0.01)
    print(s.grants)
""")


def test_gpushare_adds_no_dynamo_frames_graphs_or_breaks(node_factory, short_tmp):
    prog = short_tmp / "compiled.py"
    prog.write_text(COMPILED)
    bare = subprocess.run(
        [sys.executable, str(prog), "0"], capture_output=True, text=True, timeout=240
    )
    assert bare.returncode == 0, bare.stderr
    want = json.loads(bare.stdout.splitlines()[-1])
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.3", idle_release="0.2"))
    rival = gs_run(node, "--memory", "4GiB", "--", sys.executable, "-c", RIVAL, "30")
    pr = gs_run(node, "--memory", "4GiB", "--", sys.executable, str(prog), "6")
    out, err = pr.communicate(timeout=240)
    rival.kill()
    rival.communicate()
    assert pr.returncode == 0, err
    got = json.loads(out.splitlines()[-1])
    assert got["grants"] >= 2, got  # the rival took turns: revokes came, at the hooks
    keys = ("frames", "graphs", "breaks")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (got, want)

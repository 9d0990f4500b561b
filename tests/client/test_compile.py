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

    def grants():  # this program's grants so far, as a session (not imported bare)
        from gpushare.client import runner
        return runner.SESSION.grants if runner.SESSION else 0

    # SECONDS and 5 steps at least, and under gpushare until granted WANT times (a rival
    # revoked it: counted, not a window a busy machine may not fill); 120 s at most
    end, steps, hard = time.monotonic() + float(sys.argv[1]), 0, time.monotonic() + 120
    want = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    while (time.monotonic() < end or steps < 5 or (want and grants() < want)) and (
        time.monotonic() < hard
    ):
        (inplace(x).sum() + wrapped(x).sum()).backward()
        steps += 1
        time.sleep(0.01)  # a step's pace
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
            time.sleep(0.05)  # GPU work
        time.sleep(0.01)  # then a gap: the others' turn
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
    rival = gs_run(node, "--memory", "4GiB", "--", sys.executable, "-c", RIVAL, "120")
    pr = gs_run(node, "--memory", "4GiB", "--", sys.executable, str(prog), "1", "2")
    out, err = pr.communicate(timeout=240)
    rival.kill()
    rival.communicate()
    assert pr.returncode == 0, err
    got = json.loads(out.splitlines()[-1])
    assert got["grants"] >= 2, got  # the rival took turns: revokes came, at the hooks
    keys = ("frames", "graphs", "breaks")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, (got, want)


NESTED = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) + x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    compiled = torch.compile(Net(), backend="eager")  # dynamo is loaded only now
    x = torch.randn(8, 16)
    for _ in range(4):
        compiled(x).sum().backward()
    print(json.dumps({"frames": counters["frames"]["total"],
                      "graphs": counters["stats"]["unique_graphs"]}))
""")


def test_torch_compile_of_a_model_with_submodules_compiles_what_bare_does(node_factory, short_tmp):
    # issue 25: the skip marks were applied only when dynamo was loaded at attach or by
    # Module.compile(): torch.compile(model) traced the hooks (3 frames against 1 bare)
    prog = short_tmp / "nested.py"
    prog.write_text(NESTED)
    bare = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=240)
    assert bare.returncode == 0, bare.stderr
    want = json.loads(bare.stdout.splitlines()[-1])
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--memory", "1GiB", "--", sys.executable, str(prog))
    out, err = pr.communicate(timeout=240)
    assert pr.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == want
    # PyTorch's warning about global hooks (they fire once more for the OptimizedModule:
    # gpushare's are made for it) came at every call; at most once now
    assert err.count("when there are global hooks") <= 1, err


SLOW_COMPILE = textwrap.dedent("""
    import json, sys, time, torch

    def slow(gm, example_inputs):  # a backend that compiles for seconds, as inductor does
        time.sleep(float(sys.argv[1]))
        return gm.forward

    m = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), backend=slow)
    x = torch.randn(4, 8)
    for _ in range(20):
        m(x).sum().backward()
        time.sleep(0.01)  # a step's pace
    print(json.dumps({"done": True}))
""")


def test_a_program_compiling_gives_the_gpu_back_and_is_not_escalated(node_factory, short_tmp):
    # issue 25: torch.compile compiles inside the first forward, where no safe point comes:
    # compiles of 11-21 s against a 5 s grace were escalated (SIGKILL with --escalation kill)
    prog = short_tmp / "slow_compile.py"
    prog.write_text(SLOW_COMPILE)
    node = node_factory(
        *sim("16GiB", mode="exclusive", tq="0.3", idle_release="0.2", grace="1", escalation="kill")
    )
    rival = gs_run(
        node, "--memory", "4GiB", "--name", "rival", "--", sys.executable, "-c", RIVAL, "60"
    )
    try:
        pr = gs_run(
            node, "--memory", "4GiB", "--name", "compiles", "--", sys.executable, str(prog), "4"
        )
        out, err = pr.communicate(timeout=240)
    finally:
        rival.kill()
        rival.communicate()
    assert pr.returncode == 0 and json.loads(out.splitlines()[-1]) == {"done": True}, err
    events = node.event_list()
    sid = next(
        e["session"] for e in events if e["event"] == "attach" and e.get("name") == "compiles"
    )
    assert not [e for e in events if e["event"] == "escalate" and e.get("session") == sid]
    assert err.count("gives the GPU back while torch.compile compiles") == 1, err


INDUCTOR = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    cm = torch.compile(m)  # inductor, the default backend: a forward and a backward compiled
    x = torch.randn(8, 16)
    for _ in range(5):
        loss = cm(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("final", f"{loss.item():.10f}", f"{sum(p.sum().item() for p in m.parameters()):.10f}")
""")


@pytest.mark.slow
def test_an_inductor_compiled_model_beside_a_rival_finishes_with_its_bare_results(
    node_factory, short_tmp
):
    # issue 25: the lease was given back at the compile's start, but AOT autograd traces
    # the backward by calling torch.autograd.grad, a safe point, which asked for it again
    # at once: inductor then compiled holding it, and the program was SIGKILLed past the
    # grace (11.4 s, no_yield_within_grace). Each run compiles afresh (its own cache).
    import os

    prog = short_tmp / "inductor.py"
    prog.write_text(INDUCTOR)

    def cache(name: str) -> dict[str, str]:
        return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(short_tmp / name)}

    bare = subprocess.run(
        [sys.executable, str(prog)], capture_output=True, text=True, timeout=600, env=cache("b")
    )
    assert bare.returncode == 0, bare.stderr
    want = bare.stdout.splitlines()[-1]
    node = node_factory(
        *sim("16GiB", mode="exclusive", tq="0.3", idle_release="0.2", grace="1", escalation="kill")
    )
    rival = gs_run(
        node, "--memory", "4GiB", "--name", "rival", "--", sys.executable, "-c", RIVAL, "600"
    )
    try:
        pr = gs_run(
            node, "--memory", "4GiB", "--name", "inductor", "--", sys.executable, str(prog),
            extra_env={"TORCHINDUCTOR_CACHE_DIR": str(short_tmp / "g")},
        )  # fmt: skip
        out, err = pr.communicate(timeout=600)
    finally:
        rival.kill()
        rival.communicate()
    events = node.event_list()
    sid = next(
        e["session"] for e in events if e["event"] == "attach" and e.get("name") == "inductor"
    )
    assert not [e for e in events if e["event"] == "escalate" and e.get("session") == sid], err
    assert pr.returncode == 0 and out.splitlines()[-1] == want, err
    assert len([e for e in events if e["event"] == "grant" and e["session"] == sid]) >= 2
    assert err.count("gives the GPU back while torch.compile compiles") == 1, err
    assert "recompil" not in err, err  # the hooks add no guard that fails when the code runs

"""``gpushare run``: unmodified PyTorch programs (the CPU build) gated on the lease at
PyTorch's global hooks, against a real node on a simulated GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.support import sim, wait_until

torch = pytest.importorskip(
    "torch",
    reason="PyTorch is not installed (make test installs the CPU build where its wheel is on disk)",
)

STEPS = 20
# Trains for SECONDS and at least STEPS steps (a busy machine makes each step slower: the
# work is counted, not the time it took); with TOGETHER ("DIR:N"), the seconds count from
# when N programs have trained a step (each says so with a file in DIR), so that they
# overlap however late each started. 120 s at most: a test fails, never hangs.
TRAIN = textwrap.dedent("""
    import json, os
    import sys, time, torch
    from gpushare.client import runner
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    s = runner.SESSION
    print(json.dumps({"session": s.id, "limit": s.memory_limit, "weight": s.weight}), flush=True)
    seconds, least = float(sys.argv[1]), STEPS
    together = os.environ.get("TRAIN_TOGETHER", "")
    hard = time.time() + 120
    end, steps, joined = time.time() + seconds, 0, not together
    while time.time() < hard and (time.time() < end or steps < least or not joined):
        loss = ((m(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if not joined:
            d, n = together.rsplit(":", 1)
            open(os.path.join(d, str(os.getpid())), "a").close()
            if len(os.listdir(d)) >= int(n):
                joined, end = True, time.time() + seconds
        time.sleep(0.002)  # a step's pace: the CPU left to others
    idle = float(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(json.dumps({"steps": steps, "grants": s.grants, "holding": s.holding}), flush=True)
    time.sleep(idle)  # no GPU work: the lease goes back after idle_release
""").replace("STEPS", str(STEPS))


@pytest.fixture
def script(short_tmp):
    p = short_tmp / "train.py"
    p.write_text(TRAIN)
    return p


def gs_run(node, *args, extra_env=None, **kw) -> subprocess.Popen[str]:
    import os

    env = {**os.environ, **(extra_env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "gpushare", "run", "--socket", node.socket, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def lines(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


def run_program(node_factory, code: str) -> list[dict]:
    """Run ``python -c code`` under ``gpushare run`` against a simulated node whose
    implicit bursts end after 0.2 s idle; the JSON lines it printed."""
    node = node_factory(*sim("16GiB", idle_release="0.2"))
    pr = gs_run(node, "--", sys.executable, "-c", code)
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 0, err
    return lines(out)


def test_an_unmodified_program_becomes_a_session(node_factory, script):
    node = node_factory(*sim("16GiB", idle_release="0.3"))
    pr = gs_run(
        node,
        "--memory",
        "2GiB",
        "--name",
        "trainer",
        "--",
        sys.executable,
        str(script),
        "1.0",
        "1.5",
    )
    first = json.loads(pr.stdout.readline())
    assert first["limit"] == 2 * 2**30
    trained = json.loads(pr.stdout.readline())  # now 1.5 s without work
    assert trained["steps"] >= STEPS and trained["grants"] >= 1, trained

    def idle() -> bool:
        return any(
            s["state"] == "idle" and s["name"] == "trainer"
            for s in node.status()["gpus"][0]["sessions"]
        )

    wait_until(idle, timeout=10, what="the lease to go back after idle_release")
    _, err = pr.communicate(timeout=120)  # its exit: bounded loosely, as a loaded machine needs
    assert pr.returncode == 0, err
    ev = [e for e in node.event_list() if e.get("session") == first["session"]]
    kinds = [e["event"] for e in ev]
    assert kinds[0] == "attach" and "grant" in kinds and kinds[-1] == "detach"
    assert any(e["event"] == "release" and e["reason"] == "burst_end" for e in ev)


def test_two_programs_take_turns_at_the_hooks(node_factory, script, short_tmp):
    node = node_factory(*sim("16GiB", mode="exclusive", tq="0.3", idle_release="0.3"))
    (short_tmp / "in").mkdir()
    env = {"TRAIN_TOGETHER": f"{short_tmp / 'in'}:2"}  # 3 s from when both train
    procs = [
        gs_run(node, "--memory", "4GiB", "--name", f"job{i}", "--", sys.executable, str(script),
               "3.0", extra_env=env)
        for i in range(2)
    ]  # fmt: skip
    results = []
    for pr in procs:
        out, err = pr.communicate(timeout=150)
        assert pr.returncode == 0, err
        results.append(lines(out))
    ids = [r[0]["session"] for r in results]
    assert all(r[1]["steps"] >= STEPS and r[1]["grants"] >= 2 for r in results), results
    ev = node.event_list()
    revoked = {e["session"] for e in ev if e["event"] == "release" and e["reason"] == "revoked"}
    assert set(ids) <= revoked  # each was revoked and yielded at a hook
    # and never held together: grants and releases alternate on the GPU
    holder = None
    for e in ev:
        if e["event"] == "grant":
            assert holder is None, "two holders in exclusive mode"
            holder = e["session"]
        elif e["event"] in ("release", "detach") and e.get("session") == holder:
            holder = None


def test_three_programs_requesting_less_than_their_limits_hold_together(
    node_factory, script, short_tmp
):
    """Limits of 60 GiB each on 80 GiB would take turns; requests of 20 GiB hold together
    (mode auto), each program's session told its request and its limit."""
    node = node_factory(*sim("80GiB", mode="auto", tq="0.5", idle_release="0.3"))
    (short_tmp / "in").mkdir()
    env = {"TRAIN_TOGETHER": f"{short_tmp / 'in'}:3"}  # each trains until all three do
    procs = [
        gs_run(node, "--memory", "20GiB", "--memory-limit", "60GiB", "--name", f"job{i}",
               "--", sys.executable, str(script), "3.0", extra_env=env)
        for i in range(3)
    ]  # fmt: skip
    for pr in procs:
        out, err = pr.communicate(timeout=150)
        assert pr.returncode == 0, err
        assert lines(out)[1]["steps"] >= STEPS
        assert "memory request 20.0 GiB, memory limit 60.0 GiB" in err, err
    ev = node.event_list()
    holding: set[int] = set()
    most = 0
    for e in ev:
        if e["event"] == "grant":
            holding.add(e["session"])
        elif e["event"] in ("release", "detach"):
            holding.discard(e["session"])
        most = max(most, len(holding))
    assert most == 3
    assert not [e for e in ev if e["event"] == "revoke"]  # nobody had to wait for memory


def test_gpu_portion_sets_the_limit(node_factory, script):
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", sys.executable, str(script), "0.1", extra_env={"GPU_PORTION": "0.25"})
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 0, err
    first = lines(out)[0]
    assert first["limit"] == 4 * 2**30 and first["weight"] == 0.25


def test_a_shadowed_sitecustomize_still_runs(node_factory, short_tmp):
    other = short_tmp / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    node = node_factory(*sim("16GiB"))
    code = (
        "import os; from gpushare.client import runner; print(os.environ.get('SHADOWED_RAN'), "
        "runner.SESSION is not None)"
    )
    pr = gs_run(node, "--", sys.executable, "-c", code, extra_env={"PYTHONPATH": str(other)})
    out, err = pr.communicate(timeout=60)
    assert out.split() == ["1", "True"], err


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        ([], 2, "no command"),
        (["--memory", "lots", "--", "true"], 2, "write it like"),
        (["--", "no-such-program-xyz"], 127, "command not found"),
    ],
)
def test_bad_invocations(node_factory, args, code, message):
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, *args)
    _, err = pr.communicate(timeout=120)
    assert pr.returncode == code and message in err


def test_no_node_is_a_clear_error(short_tmp, script):
    pr = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpushare",
            "run",
            "--socket",
            str(short_tmp / "none.sock"),
            "--",
            sys.executable,
            str(script),
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pr.returncode == 3 and "start it with 'gpushare node'" in pr.stderr


def test_moves_to_and_from_the_gpu_are_gated_too(node_factory):
    # The CPU build cannot reach a GPU, but the gate runs first: a move that names CUDA
    # opens a burst (waiting for the lease) before PyTorch says it has no CUDA.
    code = textwrap.dedent("""
        import json, time, torch
        from gpushare.client import runner
        s = runner.SESSION
        t = torch.ones(4)
        t.to("cpu"); t.to(torch.float64); t.item() if t.numel() == 1 else t.sum().item()
        t.copy_(torch.zeros(4)); t.tolist(); t.cpu(); t.numpy()
        torch.zeros(2); torch.zeros_like(t); torch.empty_like(input=t); torch.arange(3)
        quiet = s.grants
        seen = []
        for move in (lambda: t.to("cuda"), lambda: t.cuda(), lambda: t.to(0),
                     lambda: t.to(device=torch.device("cuda", 0)),
                     lambda: torch.nn.Linear(2, 2).to("cuda"),
                     lambda: torch.zeros(2, device="cuda"),
                     lambda: torch.full_like(t, 1.0, device="cuda:0")):
            try:
                move()
            except (AssertionError, RuntimeError):  # "Torch not compiled with CUDA enabled"
                pass
            seen.append(s.grants)
            while s.holding:  # idle_release hands the lease back before the next move
                time.sleep(0.05)  # a look every 50 ms (the test's timeout bounds it)
        print(json.dumps({"quiet": quiet, "seen": seen}))
    """)
    r = run_program(node_factory, code)[0]
    assert r["quiet"] == 0  # CPU-only moves never asked for the GPU
    assert r["seen"] == [1, 2, 3, 4, 5, 6, 7], r  # each opened a burst of its own


def test_a_long_forward_or_backward_keeps_the_lease(node_factory):
    # A forward or backward pass longer than idle_release: the burst stays open through
    # it (a revoke would wait for the next safe point).
    code = textwrap.dedent("""
        import json, time, torch
        from gpushare.client import runner
        s = runner.SESSION
        seen = []

        class Slow(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                time.sleep(1.0)  # five times idle_release
                seen.append(s.holding)
                return g * 2

        m = torch.nn.Linear(4, 1)
        loss = Slow.apply(m(torch.ones(2, 4))).sum()  # the forward opens a burst
        loss.backward()
        g = torch.autograd.grad(Slow.apply(m(torch.ones(2, 4))).sum(), m.weight)

        class Big(torch.nn.Module):  # one module, one long forward
            def forward(self, x):
                time.sleep(1.0)
                seen.append(s.holding)
                return x

        Big()(torch.ones(1))
        try:
            torch.nn.Sequential(Big(), torch.nn.Linear(3, 1))(torch.ones(2))  # raises
        except RuntimeError:
            pass
        t = time.monotonic()  # the forward hooks stayed balanced: idleness ends the burst
        while s.holding and time.monotonic() - t < 30:  # soon (not a fixed 0.6 s)
            time.sleep(0.05)
        print(json.dumps({"seen": seen, "grants": s.grants, "after": s.holding}))
    """)
    r = run_program(node_factory, code)[0]
    assert r["seen"] == [True, True, True, True] and r["grants"] == 1, r
    assert r["after"] is False, r


def test_a_forked_child_is_not_gated(node_factory):
    # DataLoader workers are forked: the hooks they inherit must leave them alone.
    code = textwrap.dedent("""
        import json, os, time, torch
        from gpushare.client import runner
        m = torch.nn.Linear(4, 1)
        m(torch.ones(1, 4)).sum().backward()  # the parent: a session, gated
        while runner.SESSION.holding:  # idle: a gated call would have to ask the node
            time.sleep(0.05)  # a look every 50 ms (the test's timeout bounds it)
        pid = os.fork()
        if pid == 0:
            try:
                m(torch.ones(1, 4)).sum().backward()
                torch.ones(1).item()
            except Exception as e:
                print(json.dumps({"child_error": repr(e)}), flush=True)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        m(torch.ones(1, 4)).sum().backward()
        print(json.dumps({"child_status": status, "grants": runner.SESSION.grants}))
    """)
    out = run_program(node_factory, code)
    assert out[-1]["child_status"] == 0, out


# --- launchers, foreign Pythons, allocator settings ------------------------------------

WORKER = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    from gpushare.client import runner
    from gpushare.client.launchers import gang_fields
    dist.init_process_group("gloo")
    m = torch.nn.Linear(4, 1)
    m(torch.ones(2, 4)).sum().backward()  # gated: a forward and a backward
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    s = runner.SESSION
    out = {"pid": os.getpid(), "session": s.id if s else None, "grants": s.grants if s else 0,
           "gang": gang_fields(), "sum": t.item(), "gpu": s.gpu_index if s else None,
           "local_rank": int(os.environ["LOCAL_RANK"])}
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)  # a file each: the ranks' stdout is one, their lines interleave
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("gpus", [1, 2])
def test_torchruns_workers_become_sessions_and_the_launcher_does_not(node_factory, short_tmp, gpus):
    import os
    from pathlib import Path

    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    script = short_tmp / "worker.py"
    script.write_text(WORKER)
    node = node_factory(*sim("16GiB", gpus=gpus, idle_release="0.3"))
    pr = gs_run(
        node,
        "--memory",
        "1GiB",
        "--",
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(short_tmp),
        extra_env={"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    _, err = pr.communicate(timeout=240)
    assert pr.returncode == 0, err
    ranks = [json.loads((short_tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["session"] is not None and r["grants"] >= 1 for r in ranks), ranks
    assert {r["pid"] for r in ranks}.isdisjoint({pr.pid})  # workers, not the launcher
    attached = {e["session"] for e in node.event_list() if e["event"] == "attach"}
    assert attached == {r["session"] for r in ranks}  # the launcher took no session
    gangs = [r["gang"] for r in ranks]
    assert gangs[0]["gang"].startswith("torchelastic:") and gangs[0]["gang"] == gangs[1]["gang"]
    assert sorted(g["rank"] for g in gangs) == [0, 1] and {g["gang_size"] for g in gangs} == {2}
    assert {r["sum"] for r in ranks} == {3.0}  # their collective ran
    # issue 25: every rank went to GPU 0; a rank goes where its LOCAL_RANK puts it, and
    # where the node has fewer GPUs than ranks, to the default GPU, saying so
    if gpus == 2:
        assert [(r["local_rank"], r["gpu"]) for r in ranks] == [(0, 0), (1, 1)], ranks
        assert "which the node does not have" not in err
    else:
        assert [r["gpu"] for r in ranks] == [0, 0], ranks
        assert "LOCAL_RANK 1 would be GPU 1, which the node does not have" in err, err


def test_a_python_that_cannot_import_gpushare_is_refused(node_factory, short_tmp):
    import shutil

    # The interpreter this venv was made from: gpushare is not installed in it.
    base = getattr(sys, "_base_executable", "") or shutil.which("python3")
    probe = subprocess.run([base, "-c", "import gpushare"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{base} can import gpushare: no foreign Python here")
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", base, "-c", "print('ran ungated')")
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 3 and "ran ungated" not in out
    assert "cannot import gpushare" in err and "install gpushare in it" in err
    assert "Error in sitecustomize" not in err


@pytest.mark.parametrize("flag", ["-I", "-E", "-S", "-uI"])
def test_a_python_told_to_skip_the_start_up_hook_is_refused(node_factory, flag):
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", "python3", flag, "-c", "print('ran ungated')")
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 2 and "ran ungated" not in out
    assert "ignores gpushare's start-up hook" in err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--enable-sleep-mode"], True),
        (["-m", "vllm.entrypoints.openai.api_server", "--model", "m"], False),
        (["-m", "vllm.entrypoints.openai.api_server", "--enable-sleep-mode=false"], False),
        (["-c", "pass", "--enable-sleep-mode"], False),  # not vLLM: its own flag
    ],
)
def test_vllms_sleep_mode_is_said_to_be_bounded_by_vllms_settings_alone(node_factory, args, said):
    node = node_factory(*sim("16GiB"))
    # The note comes before the program starts (vLLM need not be installed for it).
    pr = gs_run(node, "--", sys.executable, *args)
    _, err = pr.communicate(timeout=60)
    assert ("cannot refuse it past the session's memory limit" in err) == said, err
    if said:
        assert "--gpu-memory-utilization" in err and err.count("--enable-sleep-mode allocates") == 1


def test_unswappable_allocator_settings_are_taken_out_and_the_allocator_preloaded(node_factory):
    code = (
        "import json, os; print(json.dumps({k: os.environ.get(k) for k in"
        " ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF', 'LD_PRELOAD')}))"
    )
    node = node_factory(*sim("16GiB"))
    pr = gs_run(
        node,
        "--",
        sys.executable,
        "-c",
        code,
        extra_env={
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
            "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync",
        },
    )
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 0, err
    env = lines(out)[0]
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert env["PYTORCH_ALLOC_CONF"] is None
    assert "expandable_segments:True taken out" in err and "backend:cudaMallocAsync" in err
    assert "libgpushare_alloc-" in env["LD_PRELOAD"]  # PyTorch's cudaMalloc reaches gpushare


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--memory", "lots"], {}, "lots"),
        ([], {"GPUSHARE_MEMORY": "lots"}, "GPUSHARE_MEMORY"),
        ([], {"GPU_PORTION": "2"}, "GPU_PORTION"),
        # Issue 25: 1e30 overflowed in the program's sitecustomize, which then ran ungated
        (["--memory", "1e30"], {}, "more than any GPU has"),
        (["--memory", "1e400"], {}, "more than any GPU has"),
        ([], {"GPUSHARE_MEMORY": "1e30"}, "GPUSHARE_MEMORY: size 1e30 is more than any GPU"),
        (["--memory", "0"], {}, "--memory: a memory limit must be more than 0"),
        (["--memory-limit", "0"], {}, "--memory-limit: a memory limit must be more than 0"),
        (
            ["--memory", "8GiB", "--memory-limit", "4GiB"],
            {},
            "--memory-limit 4.0 GiB is below --memory 8.0 GiB: give a limit at least as large",
        ),
        (["--memory", "8GiB"], {"GPUSHARE_MEMORY_LIMIT": "2GiB"}, "is below the request 8.0 GiB"),
        (["--memory-limit", "2x"], {}, "--memory-limit: "),
        (["--compute-limit", "2"], {}, "is not a fraction of the GPU's time in (0, 1]"),
        ([], {"GPUSHARE_COMPUTE_LIMIT": "x"}, "GPUSHARE_COMPUTE_LIMIT='x' is not a fraction"),
        # ... and a wrong weight was said to be fixed with --memory
        (["--weight", "0"], {}, "argument --weight: weight '0' is not a number from 0.001"),
        (["--weight", "-1"], {}, "argument --weight: weight '-1' is not a number from 0.001"),
        (["--weight", "nan"], {}, "argument --weight: weight 'nan'"),
    ],
)
def test_a_wrong_size_weight_or_portion_is_a_usage_error_wherever_it_is_given(
    node_factory, args, env, said
):
    # GPUSHARE_MEMORY was read only by the program's attach: exit 3 (a refusal), where
    # the same value given as --memory was exit 2 (a usage error), before the program
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, *args, "--", "python3", "-c", "print('ran')", extra_env=env)
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 2 and "ran" not in out, (pr.returncode, err)
    assert said in err and len(err.strip().splitlines()) == 1, err


def states(node) -> dict[str, str]:
    return {s["name"]: s["state"] for s in node.status()["gpus"][0]["sessions"]}


def test_ctrl_c_while_waiting_for_the_lease_is_one_line_and_exit_130(node_factory, short_tmp):
    # issue 25: Ctrl-C in the wait printed a 25-line traceback through gpushare's frames
    import signal

    slow = short_tmp / "slow.py"  # a forward pass every 50 ms: the holder leaves CPU free
    slow.write_text(
        "import time, torch\nm = torch.nn.Linear(4, 4)\n"
        "while True:\n    m(torch.zeros(1, 4))\n    time.sleep(0.05)  # between passes\n"
    )
    node = node_factory(*sim("16GiB", mode="exclusive", tq="600", idle_release="5"))
    holder = gs_run(node, "--memory", "6GiB", "--name", "a", "--", sys.executable, str(slow))
    try:
        wait_until(lambda: states(node).get("a") == "holding", timeout=120, what="a to hold")
        waiter = gs_run(node, "--memory", "6GiB", "--name", "b", "--", sys.executable, str(slow))
        wait_until(lambda: states(node).get("b") == "waiting", timeout=120, what="b to wait")
        waiter.send_signal(signal.SIGINT)
        _, err = waiter.communicate(timeout=60)
    finally:
        holder.kill()
        holder.communicate()
    said = [line for line in err.splitlines() if not line.startswith("gpushare run: attached")]
    assert len(said) == 1 and re.fullmatch(
        r"gpushare run: interrupted \(Ctrl-C\) while session 2 \(b\) waited( [0-9.]+ s)? for"
        r" the GPU: stopped",
        said[0],
    ), err
    # killed by its SIGINT, as Python does it: a shell shows 130
    assert waiter.returncode in (-signal.SIGINT, 130), waiter.returncode


@pytest.mark.parametrize("code", ["raise ValueError('boom')", "raise KeyboardInterrupt('boom')"])
def test_an_error_of_the_programs_own_keeps_its_traceback(node_factory, code):
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", sys.executable, "-c", code)
    _, err = pr.communicate(timeout=60)
    assert "Traceback (most recent call last)" in err and "boom" in err, err
    assert "interrupted" not in err


def test_a_program_that_execs_python_stays_a_session(node_factory):
    # issue 25: os.execv dropped the session silently (the flag was taken out of the
    # environment the exec inherits), and the exec'd program ran ungated
    code = textwrap.dedent("""
        import os, sys
        from gpushare.client import runner
        print("before", runner.SESSION.id, flush=True)
        after = "from gpushare.client import runner; print('after', runner.SESSION.id)"
        os.execv(sys.executable, [sys.executable, "-c", after])
    """)
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--name", "execs", "--", sys.executable, "-c", code)
    out, err = pr.communicate(timeout=120)
    assert pr.returncode == 0, err
    said = dict(line.split() for line in out.splitlines())
    assert set(said) == {"before", "after"} and said["before"] != said["after"], out
    assert err.count("gpushare run: attached as session") == 2, err


def test_a_python_program_the_session_starts_is_not_a_session(node_factory):
    code = textwrap.dedent("""
        import subprocess, sys
        child = "from gpushare.client import runner; print(runner.SESSION)"
        subprocess.run([sys.executable, "-c", child], check=True)
    """)
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", sys.executable, "-c", code)
    out, err = pr.communicate(timeout=120)
    assert pr.returncode == 0 and out.split() == ["None"], (out, err)
    assert err.count("gpushare run: attached as session") == 1, err


def test_ranks_of_torch_multiprocessing_spawn_are_said_to_run_ungated(node_factory, short_tmp):
    # issue 25: DDP by torch.multiprocessing.spawn ran its ranks ungated without a word
    prog = short_tmp / "ddp.py"
    prog.write_text(
        textwrap.dedent("""
        import torch.multiprocessing as mp

        def rank(i):
            import torch
            try:
                torch.cuda.init()  # said for them by the parent: nothing of their own
            except (AssertionError, RuntimeError):
                pass

        if __name__ == "__main__":
            mp.spawn(rank, nprocs=2)
            mp.spawn(rank, nprocs=2)
    """)
    )
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", sys.executable, str(prog))
    _, err = pr.communicate(timeout=180)
    assert pr.returncode == 0, err
    said = [line for line in err.splitlines() if "torch.multiprocessing" in line]
    assert len(said) == 1, err  # once
    assert "starts 2 processes that run ungated: only this one (pid" in said[0]
    assert "gpushare run -- torchrun --nproc-per-node 2 train.py" in said[0]
    assert "uses CUDA ungated" not in err, err


def test_a_command_that_is_not_python_is_said_to_run_ungated(node_factory, short_tmp):
    # issue 25: a non-Python command ran ungated with no warning
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", "sh", "-c", "echo ran")
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 0 and out.strip() == "ran", err
    assert err.strip().splitlines() == [
        "gpushare run: sh is not a Python program: only the Python programs it starts are"
        " gated (each a session of its own); the rest runs ungated"
    ]
    script = short_tmp / "tool"
    script.write_text("#!/usr/bin/env python3\nprint('ran')\n")
    script.chmod(0o755)
    pr = gs_run(node, "--", str(script))
    _, err = pr.communicate(timeout=60)
    assert "not a Python program" not in err, err


def test_a_spawned_child_that_uses_cuda_joins_the_session(node_factory, short_tmp):
    # issue 28: a multiprocessing child (spawn, forkserver: an engine's workers) was not
    # a session, and used the GPU ungated without a word; now it joins the session at
    # its CUDA start, saying so; one that never asks for CUDA nor runs a model does not
    prog = short_tmp / "children.py"
    prog.write_text(
        textwrap.dedent("""
        import multiprocessing as mp, sys

        def uses_cuda():
            import torch
            try:
                torch.cuda.init()  # a CPU build raises; asking for CUDA is what joins
            except (AssertionError, RuntimeError):
                pass

        def cpu_only():
            import torch
            torch.zeros(2).sum()

        if __name__ == "__main__":
            for method in ("spawn", "forkserver"):
                for target in (uses_cuda, cpu_only):
                    p = mp.get_context(method).Process(target=target)
                    p.start()
                    p.join()
                    assert p.exitcode == 0, p.exitcode
    """)
    )
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", sys.executable, str(prog))
    _, err = pr.communicate(timeout=240)
    assert pr.returncode == 0, err
    said = [line for line in err.splitlines() if "starts CUDA: joined session" in line]
    assert len(said) == 2, err  # the two children that asked for CUDA, once each
    assert "uses CUDA ungated" not in err


MODELLED = """
import json, os, sys, time, torch
m = torch.nn.Linear(1024, 1024)
x = torch.randn(2, 1024)
m(x)  # its first forward: its weights modelled on the simulated GPU
print(json.dumps({"ready": True}), flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
m(x)  # after a rival's turn: its modelled memory back, every chunk checked
print(json.dumps({"done": True}), flush=True)
"""


@pytest.mark.parametrize("model", ["weights", "declared"])
def test_a_cpu_run_programs_memory_is_modelled_and_swapped(node_factory, short_tmp, model):
    """Issue 40: a CPU-run PyTorch program on a simulated GPU showed 0 B resident, so
    its switches moved nothing. With --sim-resident its modules' weights (or its
    request) are its resident bytes, said in the status, swapped out for a rival and
    back, checked."""
    pytest.importorskip("torch")
    import gpushare

    node = node_factory(*sim("16GiB", mode="exclusive", idle_release="0.2"))
    prog, go = short_tmp / "modelled.py", short_tmp / "go"
    prog.write_text(MODELLED)
    pr = gs_run(node, "--memory", "12GiB", "--sim-resident", model, "--name", "cpu-model",
                "--", sys.executable, str(prog), str(go))  # fmt: skip
    assert pr.stdout is not None
    assert json.loads(pr.stdout.readline()) == {"ready": True}
    want = 1024 * 1024 * 4 + 1024 * 4 if model == "weights" else 12 * 2**30

    def modelled() -> dict | None:
        rows = [s for s in node.status()["gpus"][0]["sessions"] if s["name"] == "cpu-model"]
        return rows[0] if rows and rows[0]["resident_bytes"] == want else None

    row = wait_until(modelled, 60, "the program's modelled memory in the node's status")
    assert row["resident_model"] == model
    said = "resident modelled, not allocated (gpushare run --sim-resident): sessions"
    assert f"{said} {row['id']} ({model})" in node.ctl("status").stdout
    rival = gpushare.attach("8GiB", socket=node.socket, name="rival")
    with rival.gpu():
        rival.backend.allocate(8 * 2**30)  # past what fits beside a declared 12 GiB
        if model == "declared":
            moved = next(s for s in node.status()["gpus"][0]["sessions"] if s["id"] == row["id"])
            assert moved["swapped_bytes"] >= 4 * 2**30  # a switch that moves its bytes
    rival.close()
    go.touch()
    out, err = pr.communicate(timeout=120)
    assert pr.returncode == 0, err
    assert lines(out) == [{"done": True}]


@pytest.mark.parametrize("word", ["bogus", "WEIGHTS"])
def test_an_unknown_sim_resident_model_is_a_usage_error_in_one_line(node_factory, word):
    """A new user's trial: the variable's wrong value exited 3 from the program's
    Python (a wrong GPUSHARE_MEMORY exits 2, before it starts), and took WEIGHTS where
    --sim-resident refuses it. Said by gpushare run, exit 2, nothing of it run."""
    node = node_factory(*sim("16GiB"))
    pr = gs_run(node, "--", sys.executable, "-c", "print('ran')",
                extra_env={"GPUSHARE_SIM_RESIDENT": word})  # fmt: skip
    out, err = pr.communicate(timeout=60)
    assert pr.returncode == 2 and "ran" not in out
    assert f"GPUSHARE_SIM_RESIDENT={word!r}: choose one of none, weights, declared" in err
    assert len(err.strip().splitlines()) == 1, err

"""Configuration that lasts and changes live: the watched config file (a ConfigMap in
Kubernetes), the node's state file for --persist, their precedence (a node in process on
virtual time: a look at the files each second); and a pod placed by KAI attaching with no
setting of its own (real processes)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import types

import gpushare
from gpushare import protocol as p
from gpushare.node.keep.config import load
from tests.node.harness import InProcessNode, in_process
from tests.support import FIXTURES, sim

FIX = FIXTURES


def tqs(node: InProcessNode) -> list[float]:
    return [a.settings.tq_s for a in node.node.arbiters]


@in_process(gpus=2, files={"config": "tq = 30.0\n"})
async def test_config_file_changes_apply_live(node, caplog):
    caplog.set_level(logging.INFO, logger="gpushare")
    cfg = node.dir / "config.toml"
    assert tqs(node) == [30, 30]
    cfg.write_text('tq = 12.0\n[gpu.1]\nmode = "exclusive"\n')
    await node.until(lambda: tqs(node) == [12, 12])  # at the next look (1 s)
    assert node.node.arbiters[1].settings.mode == "exclusive"
    assert node.node.arbiters[0].settings.mode == "auto"
    assert "changed: GPU 0 {'tq': 12.0}" in caplog.text  # by the file's key
    assert [e["gpu"] for e in node.events("config")] == [0, 1]
    # bad edits: refused (a log line, an event), and the configuration in force is kept
    bad_edits = [
        "tq = [broken\n",
        "tq = -1.0\n",
        "tq = 1e12\n",
        '[gpu.1]\nmode = "fastest"\n',
        "[gpu.5]\ntq = 3.0\n",  # this node has GPUs 0 and 1
        "tq = 12.0\nmetrics_port = 99999\n",
        "tq = 12.0\nidle_release = -3\n",
        "tq = 12.0\nsim_swap_failure_rate = 7\n",
    ]
    for i, bad in enumerate(bad_edits, start=1):
        caplog.clear()
        cfg.write_text(bad)
        await node.until(lambda i=i: len(node.events("config_refused")) == i)
        assert "keeping the configuration in force" in caplog.text
        assert tqs(node) == [12, 12] and node.node.arbiters[1].settings.mode == "exclusive"
    reasons = [e["reason"] for e in node.events("config_refused")]
    assert "[gpu.5]: this node has 2 GPUs" in reasons[4] and "metrics_port" in reasons[5]
    assert all(e["source"] == f"file {cfg}" for e in node.events("config_refused"))
    assert len(node.events("config")) == 2
    # and the next good edit applies as usual
    cfg.write_text("tq = 9.0\n")
    await node.until(lambda: tqs(node) == [9, 9])


LIVE_EDITS = [  # a line of the config file, the setting it changes, its new value
    ("overlap = false", "overlap", False),
    ("prefetch = false", "prefetch", False),
    ("idle_release = 2.0", "anticipate_s", 2.0),
    ("turn = 0.0", "turn_s", 0.0),
    ("turn_share = 0.5", "turn_share", 0.5),
    ('mode = "exclusive"', "mode", "exclusive"),
    ('policy = "weighted"', "policy", "weighted"),
    ('escalation = "freeze"', "escalation", "freeze"),
    ("tq = 7.0", "tq_s", 7.0),
]


@in_process(gpus=2, files={"config": "grace = 5.0\n"})
async def test_each_live_key_changes_through_the_one_door(node):
    # Every key the file may change live goes through the arbiter's set_config: each
    # edit is one config event per GPU naming just what changed (overlap and the
    # scheduling keys too, which were set behind the arbiter's back with no event).
    cfg = node.dir / "config.toml"
    lines = ["grace = 5.0"]
    for i, (line, field, value) in enumerate(LIVE_EDITS, start=1):
        assert all(getattr(a.settings, field) != value for a in node.node.arbiters)
        lines.append(line)
        cfg.write_text("\n".join(lines) + "\n")
        await node.until(lambda i=i: len(node.events("config")) == 2 * i)
        new = node.events("config")[-2:]
        assert [e["gpu"] for e in new] == [0, 1]
        for e in new:
            assert {k: v for k, v in e.items() if k not in ("ts", "gpu", "event")} == {field: value}
        assert all(getattr(a.settings, field) == value for a in node.node.arbiters)
    # A bad value for any of them is refused whole: what is in force is kept.
    before = [vars(a.settings).copy() for a in node.node.arbiters]
    bad = ['overlap = "yes"', "prefetch = 1", "idle_release = 0.0", "turn = -1.0"]
    bad += ["turn_share = 2.0", 'policy = "fastest"', "grace = 0.0", "tq = 0.0"]
    for i, line in enumerate(bad, start=1):
        # a good change beside it (tq) is not applied either
        edit = {x.split(" ")[0]: x for x in [*lines, "tq = 3.0", line]}
        cfg.write_text("\n".join(edit.values()) + "\n")
        await node.until(lambda i=i: len(node.events("config_refused")) == i)
    await asyncio.sleep(2)  # two more looks at the last bad edit
    assert [vars(a.settings) for a in node.node.arbiters] == before
    assert len(node.events("config")) == 2 * len(LIVE_EDITS)
    reasons = [e["reason"] for e in node.events("config_refused")]
    for line, reason in zip(bad, reasons, strict=True):
        assert line.split(" ")[0] in reason.replace("TQ", "tq"), reason


@in_process(files={"config": "tq = 30.0\n"})
async def test_a_live_change_stays_unless_the_file_changes_the_same_key(node):
    cfg = node.dir / "config.toml"
    await node.ask(p.SetConfig(tq_s=7))
    cfg.write_text('tq = 30.0\npolicy = "weighted"\n')
    await node.until(lambda: node.node.arbiters[0].settings.policy == "weighted")
    assert tqs(node) == [7]  # kept: the file's TQ did not change
    cfg.write_text('tq = 10.0\npolicy = "weighted"\n')
    await node.until(lambda: tqs(node) == [10])  # the file changed it: the file's


@in_process(files={"config": "tq = 30.0\n"})
async def test_keys_read_at_start_wait_for_a_restart(node, caplog):
    cfg = node.dir / "config.toml"
    cfg.write_text("tq = 30.0\nreserve = 1024\n")
    await node.until(lambda: "takes effect when the node restarts" in caplog.text)
    assert "reserve" in caplog.text and node.node.arbiters[0].capacity == 16 * 2**30


@in_process(files={"config": 'tq = 30.0\npolicy = "equal"\n', "state": None})
async def test_state_file_outlasts_restarts_and_beats_the_configmap(node):
    cfg, state = node.dir / "config.toml", node.dir / "state.toml"
    r = await node.ask(p.SetConfig(tq_s=20, persist=True))
    assert isinstance(r, p.ConfigReply) and r.persisted_to == str(state)
    assert "tq = 20" in state.read_text()
    assert cfg.read_text() == 'tq = 30.0\npolicy = "equal"\n'  # the ConfigMap is not ours
    # a restart reads the files as the running node does
    assert load(cfg, state, {}).tq == 20
    cfg.write_text('tq = 45.0\npolicy = "weighted"\n')  # the ConfigMap changes
    await node.until(lambda: node.node.arbiters[0].settings.policy == "weighted")
    await asyncio.sleep(5)  # five more looks at the files
    assert tqs(node) == [20]  # the node's persisted TQ still wins
    assert load(cfg, state, {}).tq == 20


def test_kai_pod_needs_no_setting(node_factory, monkeypatch):
    node = node_factory(*sim("40GiB", gpus="2"))
    uuid = node.status()["gpus"][1]["uuid"]
    monkeypatch.setenv("GPUSHARE_SOCKET", node.socket)
    monkeypatch.setenv("GPU_PORTION", "0.5")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", uuid)
    monkeypatch.setenv("GPUSHARE_PODINFO", str(FIX / "podinfo-kai"))
    with gpushare.attach() as s:
        assert s.gpu_index == 1
        assert s.memory_limit == 20 * 2**30 and s.weight == 0.5
    monkeypatch.setenv("GPUSHARE_PODINFO", str(FIX / "podinfo-kai-memory"))
    monkeypatch.delenv("GPU_PORTION")
    with gpushare.attach() as s:
        assert s.memory_limit == 2000 * 2**20 and s.weight == 1.0
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-00000000-dead-beef-0000-000000000000")
    import pytest

    with pytest.raises(gpushare.GpushareError, match="NVIDIA_VISIBLE_DEVICES"):
        gpushare.attach()


@in_process(files={"config": "tq = 30.0\n"}, tq=2.0)
async def test_an_edit_a_flag_overrides_is_said_once(node, caplog):
    # issue 25: with --tq 2 given, an edit of the file's tq was ignored without a line
    cfg = node.dir / "config.toml"
    cfg.write_text("tq = 10.0\n")
    await node.until(lambda: "tq changed, not applied" in caplog.text)
    assert "the command line's --tq wins over the file" in caplog.text
    assert "restart the node without --tq" in caplog.text and tqs(node) == [2]
    cfg.write_text('tq = 11.0\npolicy = "weighted"\n')  # not said again; policy applies
    await node.until(lambda: node.node.arbiters[0].settings.policy == "weighted")
    assert caplog.text.count("tq changed, not applied") == 1 and tqs(node) == [2]
    assert "policy changed, not applied" not in caplog.text


@in_process(files={"config": "tq = 30.0\n", "state": "tq = 20.0\n"})
async def test_an_edit_the_state_file_overrides_is_said_once(node, caplog):
    cfg = node.dir / "config.toml"
    cfg.write_text("tq = 45.0\n")
    await node.until(lambda: "tq changed, not applied" in caplog.text)
    assert "(ctl --persist) wins over the file" in caplog.text and tqs(node) == [20]


@in_process(files={"config": "tq = 30.0\n", "state": None})
async def test_a_persist_waiting_for_the_disk_holds_up_no_other_request(node, monkeypatch):
    # The file's fsync slowed as a disk being filled beside the node makes it: until the
    # test lets it go, a status asked meanwhile must still be answered (it was not: the
    # write ran on the loop, and everything waited behind it).
    from gpushare.node.keep import config as keep_config

    release, entered, left = threading.Event(), threading.Event(), threading.Event()
    real = os.fsync

    def slow_fsync(fd: int) -> None:
        entered.set()
        release.wait(10)  # real seconds: bounds the test if the loop is the one waiting
        left.set()
        real(fd)

    # the config file's module only: the session records' writes keep the real one
    monkeypatch.setattr(
        keep_config, "os", types.SimpleNamespace(**{**vars(os), "fsync": slow_fsync})
    )
    setting = asyncio.ensure_future(node.ask(p.SetConfig(tq_s=20, persist=True)))
    await node.until(entered.is_set)
    status = await node.ask(p.StatusRequest())
    answered_while_writing = not left.is_set()
    release.set()
    r = await setting
    assert answered_while_writing and isinstance(status, p.StatusReply)
    assert isinstance(r, p.ConfigReply) and r.persisted_to == str(node.dir / "state.toml")
    assert "tq = 20" in (node.dir / "state.toml").read_text() and tqs(node) == [20]

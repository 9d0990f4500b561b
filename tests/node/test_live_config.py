"""Configuration that lasts and changes live: the watched config file (a ConfigMap in
Kubernetes), the node's state file for --persist, their precedence; and a pod placed by
KAI attaching with no setting of its own."""

from __future__ import annotations

import time

import gpushare
from tests.support import FIXTURES, sim, wait_until

FIX = FIXTURES


def tqs(node) -> list[float]:
    return [g["tq_s"] for g in node.status()["gpus"]]


def test_config_file_changes_apply_live(node_factory, short_tmp):
    cfg = short_tmp / "node.toml"
    cfg.write_text("tq = 30.0\n")
    node = node_factory(*sim("16GiB", gpus="2", config=str(cfg)))
    assert tqs(node) == [30, 30]
    cfg.write_text('tq = 12.0\n[gpu.1]\nmode = "exclusive"\n')
    wait_until(lambda: tqs(node) == [12, 12], timeout=10, what="the new TQ")
    assert node.status()["gpus"][1]["mode"] == "exclusive"
    assert "changed: GPU 0 {'tq_s': 12.0}" in node.log.read_text()
    cfg.write_text("tq = [broken\n")  # a bad edit: logged, the node keeps what it had
    wait_until(
        lambda: "keeping the configuration in force" in node.log.read_text(),
        timeout=10,
        what="the parse error to be logged",
    )
    assert tqs(node) == [12, 12] and node.proc.poll() is None


def test_state_file_outlasts_restarts_and_beats_the_configmap(node_factory, short_tmp):
    cfg, state = short_tmp / "node.toml", short_tmp / "state" / "state.toml"
    cfg.write_text('tq = 30.0\npolicy = "equal"\n')
    node = node_factory(*sim("16GiB", config=str(cfg), state=str(state)))
    r = node.ctl("tq", "20", "--persist")
    assert f"persisted to {state}" in r.stdout
    assert "tq = 20" in state.read_text() and cfg.read_text() == 'tq = 30.0\npolicy = "equal"\n'
    node.restart()
    assert tqs(node) == [20]  # kept across the restart
    cfg.write_text('tq = 45.0\npolicy = "weighted"\n')  # the ConfigMap changes
    wait_until(
        lambda: node.status()["gpus"][0]["policy"] == "weighted",
        timeout=10,
        what="the ConfigMap's policy",
    )
    time.sleep(1.5)
    assert tqs(node) == [20]  # the node's persisted TQ still wins


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

import pytest

from gpushare.node.config import ConfigError, NodeConfig, load, persist


def test_missing_file_gives_defaults(tmp_path):
    assert load(tmp_path / "nope.toml") == NodeConfig()


def test_reads_values_and_gpu_tables(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('tq = 12.5\nmode = "exclusive"\n[gpu.1]\ntq = 3\n')
    c = load(f)
    assert c.tq == 12.5 and c.mode == "exclusive" and c.gpu["1"].tq == 3


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("tq = ", "not valid TOML"),
        ('mode = "fast"', "mode"),
        ("tqq = 3", "tqq"),
        ('tq = "x"', "tq"),
        ("tq = -1.0", "TQ must be a positive number"),
        ("tq = 0", "TQ must be a positive number"),
        ("grace = 0.0", "grace must be a positive number"),
        ("[gpu.1]\ntq = -2.0", r"\[gpu\.1\]: TQ must be a positive number"),
    ],
)
def test_bad_files_give_one_clear_line(tmp_path, text, match):
    f = tmp_path / "node.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        load(f)
    assert str(f) in str(e.value) and "\n" not in str(e.value)


def test_persist_all_and_one_gpu_keeps_other_keys(tmp_path):
    f = tmp_path / "sub" / "node.toml"
    persist(f, 1, tq=4.0)
    assert load(f).gpu["1"].tq == 4.0
    f.write_text('escalation = "kill"\n' + f.read_text())
    persist(f, None, tq=9.0)
    c = load(f)
    assert c.tq == 9.0 and "1" not in c.gpu and c.escalation == "kill"
    assert not list(f.parent.glob(".node.toml.*"))  # no temp files left behind


def test_persist_refuses_values_the_node_could_not_read(tmp_path):
    f = tmp_path / "node.toml"
    with pytest.raises(ConfigError, match="mode"):
        persist(f, None, mode="fastest")
    assert not f.exists()
    with pytest.raises(ConfigError, match="TQ"):
        persist(f, 0, tq=-3.0)
    assert not f.exists()


def test_flags_are_checked_as_the_files_are():
    with pytest.raises(ConfigError, match="TQ must be a positive number"):
        load(None, None, {"tq": 0.0})

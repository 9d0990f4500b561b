import pytest

from gpushare.node.keep.config import ConfigError, NodeConfig, check_gpus, load, persist


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
        ("tq = -1.0", "TQ must be positive"),
        ("tq = 0", "TQ must be positive"),
        ("tq = 1e12", "TQ must be a number of seconds from 0.05 s to 86400 s"),
        ("grace = 0.0", "grace must be positive"),
        ("[gpu.1]\ntq = -2.0", r"\[gpu\.1\]: TQ must be positive"),
        ("[gpu.x]\ntq = 2.0", r"\[gpu\.x\]: a GPU table is named by its index"),
        ("idle_release = -3", "idle_release must be positive"),
        ("max_sessions_per_uid = -1", "max_sessions_per_uid must be a whole number from 1"),
        ("sim_bandwidth = 0", "sim_bandwidth must be a number from"),
        ("sim_swap_failure_rate = 7", "sim_swap_failure_rate must be a number from 0 to 1"),
        ("metrics_port = 99999", "metrics_port must be a whole number from 0 to 65535"),
        ("hello_timeout = 0", "hello_timeout must be positive"),
        ("max_messages_per_s = 0", "max_messages_per_s must be a number from 1"),
        ('reserve = "lots"', "reserve: cannot read size"),
        ("reserve = -1", "reserve: size must not be negative"),
        ('sim_memory = "0GiB"', "sim_memory must be a positive size"),
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
    persist(f, 1, {"tq_s": 4.0})
    assert load(f).gpu["1"].tq == 4.0
    f.write_text('escalation = "kill"\n' + f.read_text())
    persist(f, None, {"tq_s": 9.0})
    c = load(f)
    assert c.tq == 9.0 and "1" not in c.gpu and c.escalation == "kill"
    assert not list(f.parent.glob(".node.toml.*"))  # no temp files left behind


def test_persist_refuses_values_the_node_could_not_read(tmp_path):
    f = tmp_path / "node.toml"
    with pytest.raises(ConfigError, match="mode"):
        persist(f, None, {"mode": "fastest"})
    assert not f.exists()
    with pytest.raises(ConfigError, match="TQ"):
        persist(f, 0, {"tq_s": -3.0})
    assert not f.exists()


def test_flags_are_checked_as_the_files_are():
    with pytest.raises(ConfigError, match="TQ must be positive"):
        load(None, None, {"tq": 0.0})


def test_a_gpu_table_for_a_gpu_the_node_lacks_is_an_error(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text("[gpu.5]\ntq = 3\n")
    cfg = load(f)
    check_gpus(cfg, 6)
    with pytest.raises(ConfigError, match=r"\[gpu\.5\]: this node has 1 GPU \(0\.\.0\)"):
        check_gpus(cfg, 1)


def test_a_named_config_file_that_does_not_exist_is_said(tmp_path, caplog):
    # a mistyped --config started the node on defaults without a word
    with caplog.at_level("WARNING", logger="gpushare.node.keep.config"):
        cfg = load(tmp_path / "nope.toml")
    assert cfg == NodeConfig()
    assert "nope.toml does not exist" in caplog.text and "--config" in caplog.text


def test_an_unknown_key_names_the_keys_there_are(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("bogus_key = 1\n")
    with pytest.raises(ConfigError, match="bogus_key") as e:
        load(p)
    assert "tq" in str(e.value) and "idle_release" in str(e.value)


def test_durations_are_read_in_the_file_as_the_flags_and_ctl_read_them(tmp_path):
    # issue 25: `tq = "30s"` was refused in the file though --tq 30s and ctl tq 30s took it
    f = tmp_path / "node.toml"
    f.write_text('tq = "30s"\ngrace = "500ms"\nidle_release = 2\n[gpu.1]\ntq = "2m"\n')
    c = load(f)
    assert (c.tq, c.grace, c.idle_release, c.gpu["1"].tq) == (30, 0.5, 2, 120)
    f.write_text('tq = "2d"\n')  # read, then checked against the range as a flag is
    with pytest.raises(ConfigError, match=r"TQ must be a number of seconds from 0\.05 s"):
        load(f)


def test_persist_keeps_a_duration_written_as_text(tmp_path):
    f = tmp_path / "node.toml"
    f.write_text('grace = "10s"\n')
    persist(f, None, {"tq_s": 4.0})
    c = load(f)
    assert (c.tq, c.grace) == (4.0, 10.0)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('tq = "soon"', "tq: cannot read duration 'soon': write it like 30s"),
        (
            "tq = [1]",
            "tq takes a number of seconds or a duration in quotes, not a list:"
            ' write it like tq = 30 or tq = "30s"',
        ),
        ("tq = true", "tq takes a number of seconds or a duration in quotes, not true"),
        (
            'kubernetes = "yes"',
            'kubernetes takes true or false, not "yes": write it like kubernetes = true',
        ),
        (
            "metrics_port = 1.5",
            "metrics_port takes a whole number, not 1.5: write it like metrics_port = 3",
        ),
        ("socket = 3", "socket takes a text in quotes, not 3"),
        (
            "reserve = [1]",
            'reserve takes a size in quotes (like "2GiB") or a number of bytes, not a list',
        ),
        ('mode = "fast"', "mode = 'fast' is not a choice: write one of 'auto', 'exclusive'"),
        ('[gpu.0]\ntq = 1\n[gpu.3]\nmode = "x"', "[gpu.3] mode = 'x' is not a choice"),
        ("[gpu.2]\ntq = [2]", "[gpu.2] tq takes a number of seconds or a duration in quotes"),
        ('[gpu.2]\ntq = "x"', "[gpu.2] tq: cannot read duration 'x'"),
        ("[gpu.1]\nbogus = 1", "[gpu.1] unknown key 'bogus': a [gpu.N] table takes tq, mode"),
        ("gpu = 3", "gpu must be tables, one per GPU: [gpu.0] then its keys"),
    ],
)
def test_a_wrong_type_is_said_in_our_words_naming_the_key_and_the_fix(tmp_path, text, said):
    # issue 25: "Expected `float`, got `str` - at `$.tq`" (the parser's words)
    f = tmp_path / "node.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(f)
    assert str(e.value).startswith(f"config file {f}: ") and said in str(e.value), e.value
    assert "Expected" not in str(e.value) and "$." not in str(e.value)

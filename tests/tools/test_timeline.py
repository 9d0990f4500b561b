import struct
from pathlib import Path

from gpushare.tools.report import read_events
from gpushare.tools.timeline import figure_size_px, lanes, plot
from tests.support import FIXTURES

FIXTURE = FIXTURES / "demo-events.jsonl"


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_lanes_pair_grants_with_releases():
    rows, t0, t1 = lanes(read_events(FIXTURE))
    assert [r.name for r in rows] == ["train-b", "train-a", "notebook"]
    for r in rows:
        assert r.leases and all(a <= b for a, b in r.leases)
        assert all(t0 <= a and b <= t1 for a, b in r.leases)
    assert sum(len(r.swaps) for r in rows) > 0


def test_png_of_the_expected_size(tmp_path):
    out = tmp_path / "t.png"
    w, h = plot(read_events(FIXTURE), out)
    assert (w, h) == figure_size_px(3) == (1200, 280)
    assert png_size(out) == (w, h)


def test_cli_draws_from_a_log(tmp_path):
    from gpushare.tools.cli import main

    out = tmp_path / "cli.png"
    assert main(["timeline", "--events", str(FIXTURE), "-o", str(out)]) == 0
    assert png_size(out) == (1200, 280)
    assert main(["timeline", "--events", str(tmp_path / "missing.jsonl"), "-o", str(out)]) == 1

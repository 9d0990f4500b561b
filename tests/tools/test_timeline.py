import struct
import subprocess
import sys
from pathlib import Path

from gpushare.tools.report import read_events
from gpushare.tools.timeline import MIN_BAR, bars, figure, figure_size_px, lanes, plot
from tests.support import FIXTURES

FIXTURE = FIXTURES / "demo-events.jsonl"
# Five programs named "mnist", 20 minutes of leases of a fraction of a second each.
MNIST = FIXTURES / "mnist-events.jsonl"


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


def test_five_lanes_of_the_same_name_are_told_apart_by_their_session():
    rows, _, _ = lanes(read_events(MNIST))
    labels = [r.label for r in rows]
    assert labels == [f"GPU 0  mnist #{i}" for i in range(1, 6)]
    assert len(set(labels)) == 5


def test_the_default_window_is_the_last_minutes_and_short_leases_stay_visible():
    events = read_events(MNIST)
    _, t0, t1 = lanes(events)
    assert t1 - t0 > 19 * 60
    rows, w0, w1 = lanes(events, window_s=300)
    assert w1 == t1 and w1 - w0 == 300
    assert all(w0 <= a for r in rows for a, _ in r.leases)
    leases = [lease for r in rows for lease in r.leases]
    assert leases and max(b - a for a, b in leases) < 1  # all sub-second
    # each drawn at least MIN_BAR of the axis: a few pixels, not a hairline
    assert all(width >= (w1 - w0) * MIN_BAR for r in rows for _, width in bars(r.leases, w0, w1))


def test_the_axis_is_wall_clock_time_and_the_lanes_are_labelled():
    from datetime import datetime

    import matplotlib.pyplot as plt

    rows, t0, t1 = lanes(read_events(MNIST), window_s=300)
    fig = figure(rows, t0, t1)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()] == [r.label for r in rows]
    ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    start = datetime.fromtimestamp(t0).strftime("%H:%M")
    assert ticks and all(len(t) == 8 and t.count(":") == 2 for t in ticks)  # HH:MM:SS
    assert any(t.startswith(start) for t in ticks)
    plt.close(fig)


def test_without_matplotlib_the_cli_says_what_to_install():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from gpushare.tools.cli import main\n"
        f"sys.exit(main(['timeline', '--events', {str(FIXTURE)!r}, '-o', 'x.png']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        "gpushare timeline: error: the timeline needs matplotlib: pip install 'gpushare[plot]'\n"
    )

import pytest

from gpushare.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (" 2 gib ", 2 * 2**30),
        ("1TiB", 2**40),
        (123, 123),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "12 parsecs", "1.2.3GiB", "1e"])
def test_parse_size_refuses_with_the_fix(bad):
    with pytest.raises(ValueError, match="write it like 80GiB"):
        parse_size(bad)


@pytest.mark.parametrize("bad", ["-1", "-1GiB", " -0.5 MiB"])
def test_a_negative_size_is_read_and_refused_as_negative(bad):
    with pytest.raises(ValueError, match="size must not be negative"):
        parse_size(bad)


def test_format_size_round_trips_units():
    assert format_size(3 * 2**30) == "3.0 GiB"
    assert format_size(512) == "512 B"
    assert format_size(1536 * 2**20) == "1.5 GiB"
    assert format_size(5 * 2**40) == "5.0 TiB"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30),
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("1d", 86400),
        ("250ms", 0.25),
        ("1e9", 1e9),  # the same as 1000000000 (issue 16: one was refused, not the other)
        ("1000000000", 1e9),
        (".5", 0.5),
        ("-5", -5),  # read, so that the range check can say "must be positive"
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_parse_duration_refuses_with_the_fix():
    with pytest.raises(ValueError, match="30s, 5m"):
        parse_duration("soon")

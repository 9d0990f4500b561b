import pytest

from gpushare.units import MAX_SIZE, format_size, parse_duration, parse_size, parse_weight


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


@pytest.mark.parametrize("big", ["1e30", "1e400", "2000TiB", 2**64])
def test_a_size_beyond_any_gpu_is_refused_in_our_words_not_overflowed(big):
    # issue 25: 1e30 was read, then overflowed the wire's 64-bit integer in the program
    with pytest.raises(ValueError, match=r"more than any GPU has.*write it like 80GiB"):
        parse_size(big)
    assert parse_size(MAX_SIZE) == MAX_SIZE


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "heavy", 1e4])
def test_a_weight_out_of_the_nodes_range_is_refused_naming_the_range(bad):
    with pytest.raises(ValueError, match=r"from 0\.001 to 1000"):
        parse_weight(bad)


def test_the_weight_range_is_the_nodes():
    from gpushare import units
    from gpushare.core import checks

    assert (units.MIN_WEIGHT, units.MAX_WEIGHT) == (checks.MIN_WEIGHT, checks.MAX_WEIGHT)
    assert parse_weight(str(checks.MIN_WEIGHT)) == checks.MIN_WEIGHT
    assert parse_weight(checks.MAX_WEIGHT) == checks.MAX_WEIGHT


def test_is_fraction_takes_only_numbers_in_range():
    from gpushare.units import is_fraction

    assert is_fraction(1) and is_fraction(0.25) and not is_fraction(0.0)
    assert not any(is_fraction(x) for x in (True, 1.5, -0.1, float("nan"), "0.5", None))
    assert is_fraction(0.5, low=0.5) and not is_fraction(0.4, low=0.5)

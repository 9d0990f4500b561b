"""A GPU's settings: one validation, whichever way a value arrives."""

from __future__ import annotations

import math
import re

import pytest

from gpushare.settings import (
    ESCALATIONS,
    MODES,
    POLICIES,
    RANGES,
    SettingsError,
    check,
    validate,
)


def test_good_values_pass_through_typed():
    assert validate(tq_s=3, mode="exclusive", policy="weighted", escalation="kill") == {
        "tq_s": 3.0,
        "mode": "exclusive",
        "policy": "weighted",
        "escalation": "kill",
    }
    assert validate() == {} and validate(mode="auto") == {"mode": "auto"}


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"tq_s": 0}, "TQ must be positive: a number of seconds from 0.05 s to 86400 s"),
        ({"tq_s": -1.5}, "TQ must be positive"),
        ({"tq_s": math.inf}, "TQ must be a number of seconds from 0.05 s"),
        ({"tq_s": math.nan}, "TQ must be a number of seconds"),
        ({"tq_s": "5"}, "TQ must be a number of seconds"),
        ({"tq_s": True}, "TQ must be a number of seconds"),
        ({"tq_s": 0.01}, "from 0.05 s to 86400 s (1 d), not 0.01"),
        ({"tq_s": 1e9}, "from 0.05 s to 86400 s (1 d), not 1e+09"),
        ({"mode": "fast"}, "mode must be one of auto, exclusive"),
        ({"policy": ""}, "policy must be one of equal, weighted"),
        ({"escalation": "KILL"}, "escalation must be one of log, freeze, kill"),
        ({"mode": "auto", "tq_s": -1}, "TQ"),  # one bad value: nothing comes back
    ],
)
def test_bad_values_are_one_line_naming_the_values_allowed(given, words):
    with pytest.raises(SettingsError) as e:
        validate(**given)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_every_value_of_each_literal_is_valid():
    for key, values in (("mode", MODES), ("policy", POLICIES), ("escalation", ESCALATIONS)):
        assert len(set(values)) == len(values)
        for v in values:
            assert validate(**{key: v}) == {key: v}


def test_every_numeric_setting_has_a_range_and_its_ends_are_valid():
    for key, r in RANGES.items():
        assert check(key, r.low) == r.low and check(key, r.high) == r.high
        for bad in (r.high * 2 + 1, r.low - 1, math.nan, "3", None, True):
            with pytest.raises(SettingsError) as e:
                check(key, bad)
            assert str(e.value).startswith(key.replace("tq", "TQ")) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("grace", -1, "grace must be positive: a number of seconds from 0.01 s"),
        ("idle_release", -3, "idle_release must be positive"),
        ("max_sessions_per_uid", -1, "max_sessions_per_uid must be a whole number from 1"),
        ("max_sessions_per_uid", 2.5, "a whole number"),
        ("sim_bandwidth", 0, "sim_bandwidth must be a number from 1000000 to 1e+13 bytes/s"),
        ("sim_swap_failure_rate", 7, "sim_swap_failure_rate must be a number from 0 to 1, not 7"),
        ("metrics_port", 99999, "from 0 to 65535 (0: no exporter), not 99999"),
        ("hello_timeout", 0, "hello_timeout must be positive"),
    ],
)
def test_each_setting_is_refused_out_of_its_range_in_one_line(key, value, words):
    with pytest.raises(SettingsError, match=re.escape(words)):
        check(key, value)


def test_a_whole_number_given_as_a_float_is_that_number():
    assert check("metrics_port", 9423.0) == 9423 and isinstance(check("sim_gpus", 2.0), int)
    assert check("tq", 1e3) == check("tq", 1000) == 1000

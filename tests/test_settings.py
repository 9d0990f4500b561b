"""A GPU's settings: one validation, whichever way a value arrives."""

from __future__ import annotations

import math

import pytest

from gpushare.settings import ESCALATIONS, MODES, POLICIES, SettingsError, validate


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
        ({"tq_s": 0}, "TQ must be a positive number of seconds"),
        ({"tq_s": -1.5}, "TQ must be a positive number"),
        ({"tq_s": math.inf}, "TQ must be a positive number"),
        ({"tq_s": math.nan}, "TQ must be a positive number"),
        ({"tq_s": "5"}, "TQ must be a positive number"),
        ({"tq_s": True}, "TQ must be a positive number"),
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

"""A hello's words checked before anything is made of it (node/serve/hello_bounds.py)."""

from __future__ import annotations

import pytest

from gpushare import protocol as p
from gpushare.node.guard import Refused
from gpushare.node.serve.hello_bounds import check_hello
from gpushare.settings import RESIDENT_MODELS


def hello(**kw: object) -> p.Hello:
    return p.Hello(version=p.PROTOCOL_VERSION, name="w", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["", *RESIDENT_MODELS])
def test_a_resident_model_gpushare_run_says_is_taken(model):
    check_hello(hello(resident_model=model))


@pytest.mark.parametrize("model", ["bogus", "Weights", "weights\x1b[2J"])
def test_an_unknown_resident_model_is_refused_in_one_line_naming_the_choices(model):
    with pytest.raises(Refused, match="resident_model must be one of weights, declared") as e:
        check_hello(hello(resident_model=model))
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)

"""The stand-in API server (tests/node/kube/apiserver.py) as a fixture."""

from collections.abc import Iterator

import pytest

from tests.node.kube.apiserver import Answer, serving


@pytest.fixture
def server() -> Iterator[tuple[Answer, int]]:
    with serving() as s:
        yield s

"""Hypothesis profiles: a test loop of seconds where you work, the full search in CI.

``dev``, the default: each property draws at most ``DEV_EXAMPLES`` examples, new ones each
run (the database keeps the ones that failed). ``ci``, where the environment has ``CI`` set
(CI sets ``CI=true``) or with ``--hypothesis-profile=ci``: each property draws the count it
names, the same examples every run (reproducible verdicts). A property names its full
count through :func:`examples`."""

from __future__ import annotations

import os

from hypothesis import settings

DEV_EXAMPLES = 25
# ci's own ceiling: every property names its count, so this is only a bound on them
FULL_EXAMPLES = 10_000

settings.register_profile("dev", max_examples=DEV_EXAMPLES)
settings.register_profile("ci", max_examples=FULL_EXAMPLES, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def examples(full: int, dev: int = DEV_EXAMPLES) -> int:
    """``full`` examples in the ci profile; in the dev profile at most ``dev`` (fewer for
    a property whose every example simulates a minute of many sessions: its loop would
    be minutes). Read when a test module is imported, after pytest loaded the profile."""
    ceiling = settings.default.max_examples
    return min(full, ceiling if ceiling > DEV_EXAMPLES else min(dev, ceiling))

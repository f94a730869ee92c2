"""Hypothesis settings for the property suites.

``HYPOTHESIS_PROFILE=ci`` (the default) runs 1,000 examples per property, derandomized, so a
CI run is repeatable and a failure reproduces on any machine. ``HYPOTHESIS_PROFILE=random``
draws fresh examples on every run (locally, to look for new cases); a failure prints the
seed and a ``@reproduce_failure`` blob to paste into the test.

The settings are applied per test (``@PROFILE``), not loaded globally, so the rest of the
test suite keeps its own example counts.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES = 1000

_COMMON = {
    "max_examples": EXAMPLES,
    "deadline": None,  # real databases and brokers: latency is not the property under test
    # The fixtures (one connection, one topic) are shared by the examples on purpose: each
    # example works in its own savepoint or on its own rows, so sharing them is correct.
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}

settings.register_profile(
    "outboxkit-properties-ci", derandomize=True, database=None, print_blob=True, **_COMMON
)
settings.register_profile("outboxkit-properties-random", print_blob=True, **_COMMON)

_NAMES = {"ci": "outboxkit-properties-ci", "random": "outboxkit-properties-random"}
_chosen = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if _chosen not in _NAMES:
    raise RuntimeError(f"HYPOTHESIS_PROFILE must be one of {sorted(_NAMES)}, got {_chosen!r}")

PROFILE = settings(settings.get_profile(_NAMES[_chosen]))
"""Decorate a ``@given`` test (or set ``TestCase.settings``) with this."""


def share(parts: int) -> settings:
    """Settings for one of *parts* tests that together make a suite of EXAMPLES cases (a
    kind of fault per test, so every kind gets its share whatever hypothesis favours)."""
    return settings(PROFILE, max_examples=-(-EXAMPLES // parts))

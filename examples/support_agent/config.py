"""Names every process of the support agent example agrees on, read from the environment
(the demo gives each run its own topic and group)."""

from __future__ import annotations

import os

MODEL_LOG = "OUTBOXKIT_AGENT_MODEL_LOG"
"""The variable naming the file where the scripted model appends a line per request."""


def topic() -> str:
    return os.environ.get("OUTBOXKIT_EXAMPLE_TOPIC", "supplier.reorders")


def group_id() -> str:
    return os.environ.get("OUTBOXKIT_EXAMPLE_GROUP", "support-reorders")

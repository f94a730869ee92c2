"""HandlerContext.of, the consumer's per-message constructor, against the dataclass's own."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from consumers.context import HandlerContext


def test_of_sets_every_field_and_builds_the_same_frozen_object() -> None:
    values = {
        "conn": object(),
        "group_id": "g",
        "message_id": "m",
        "topic": "t",
        "partition": 2,
        "offset": 7,
        "key": b"k",
        "headers": {"h": b"v"},
        "run_id": uuid.uuid4(),
        "outbox_settings": None,
    }
    # A field added to the dataclass must be added to of() too: of() skips __init__ and
    # its defaults, so a missing one would be an AttributeError in a handler.
    assert {f.name for f in dataclasses.fields(HandlerContext)} == set(values)
    fast = HandlerContext.of(**values)  # type: ignore[arg-type]
    assert fast == HandlerContext(**values)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.topic = "other"  # type: ignore[misc]

"""Checkpoints: the JSON a run resumes from, bounded in size so rows stay small."""

from __future__ import annotations

import json
from enum import Enum
from typing import Any, Final

from sqlalchemy import ColumnElement, cast, literal, null
from sqlalchemy.dialects.postgresql import JSONB

from outbox.errors import CheckpointTooLarge, ConfigurationError
from outbox.settings import OutboxSettings, default_settings


class _Keep(Enum):
    KEEP = "keep"


KEEP: Final = _Keep.KEEP
"""Pass as ``checkpoint=`` to leave the stored checkpoint as it is."""

Keep = _Keep


def encoded(value: Any) -> str:
    """*value* as compact JSON text (what is stored, and what the limit is checked against)."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"checkpoint/step result must be JSON-serialisable ({exc}); store bytes as artifacts"
        ) from exc


def encoded_size(value: Any) -> int:
    """Bytes of *value* as compact UTF-8 JSON (what the limit is checked against)."""
    return len(encoded(value).encode())


def checked_json(value: Any, settings: OutboxSettings | None) -> str | None:
    """A checkpoint as the JSON text to store, checked against ``max_checkpoint_bytes``
    (encoded once); ``None`` clears it."""
    if value is None:
        return None
    text = encoded(value)
    limit = (settings or default_settings()).max_checkpoint_bytes
    if (size := len(text.encode())) > limit:
        raise CheckpointTooLarge(size, limit)
    return text


def bounded(value: Any, settings: OutboxSettings | None) -> None:
    """Raise :class:`CheckpointTooLarge` when *value* is over ``max_checkpoint_bytes``."""
    limit = (settings or default_settings()).max_checkpoint_bytes
    if (size := encoded_size(value)) > limit:
        raise CheckpointTooLarge(size, limit)


def json_value(value: Any) -> ColumnElement[Any]:
    """*value* as a JSONB bind; ``None`` becomes JSON ``null`` (not SQL NULL)."""
    return literal(value, JSONB(none_as_null=False))


def checkpoint_value(value: Any, settings: OutboxSettings | None) -> ColumnElement[Any]:
    """A checked checkpoint as a SQL value; ``None`` clears it (SQL NULL)."""
    if value is None:
        return cast(null(), JSONB)
    bounded(value, settings)
    return json_value(value)

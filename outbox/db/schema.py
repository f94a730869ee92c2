"""Placing the Core tables in the configured PostgreSQL schema."""

from __future__ import annotations

from outbox.db.tables import SCHEMA
from outbox.settings import OutboxSettings


def translate(settings: OutboxSettings) -> dict[str | None, str | None]:
    """The ``schema_translate_map`` execution option that puts :mod:`outbox.db.tables` in
    ``settings.schema_name``: ``conn.execution_options(schema_translate_map=translate(s))``.

    Empty for the default schema: SQLAlchemy then skips rewriting every statement's text
    with a regular expression on each execution (tens of microseconds a statement).
    """
    if settings.schema_name == SCHEMA:
        return {}
    return {SCHEMA: settings.schema_name}

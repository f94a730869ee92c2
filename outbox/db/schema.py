"""Placing the Core tables in the configured PostgreSQL schema."""

from __future__ import annotations

from outbox.settings import OutboxSettings

# The schema the Core tables are declared in (outbox.db.tables). Here, not there: a daemon
# that only needs the name need not build every table at start-up (18 ms of the relay's).
SCHEMA = "outboxkit"


def translate(settings: OutboxSettings) -> dict[str | None, str | None]:
    """The ``schema_translate_map`` execution option that puts :mod:`outbox.db.tables` in
    ``settings.schema_name``: ``conn.execution_options(schema_translate_map=translate(s))``.

    Empty for the default schema: SQLAlchemy then skips rewriting every statement's text
    with a regular expression on each execution (tens of microseconds a statement).
    """
    if settings.schema_name == SCHEMA:
        return {}
    return {SCHEMA: settings.schema_name}

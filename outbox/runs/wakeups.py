"""Waking idle workers at commit: a NOTIFY whenever a run becomes claimable by someone else.

Starting a run, waking a waiting one, an operator's requeue, a confirmation that moves a
run on and a retry's requeue each add ``pg_notify(<channel>, <workflow>)`` to the select
list of the statement that makes the change: no extra round trip, and PostgreSQL delivers it
only when the transaction commits (never for one rolled back). The channel is derived from
the schema name, so workers of another schema in the same database are not woken. A worker
(:mod:`outbox.worker`) LISTENs on it and claims at once instead of polling.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from sqlalchemy import CTE, ColumnElement, func, literal

from outbox.settings import OutboxSettings, default_settings

_MAX_IDENTIFIER = 63  # PostgreSQL truncates (LISTEN) or refuses (pg_notify) longer names


def channel(settings: OutboxSettings | None) -> str:
    """The LISTEN/NOTIFY channel of the runs in *settings*' schema (``<schema>_runs``)."""
    schema = (settings or default_settings()).schema_name
    name = f"{schema}_runs"
    if len(name) > _MAX_IDENTIFIER:
        # Long schema names: a digest keeps two such schemas on different channels.
        digest = hashlib.sha256(schema.encode()).hexdigest()[:8]
        name = f"{schema[:_MAX_IDENTIFIER - 14]}_{digest}_runs"
    return name


def notify(workflow: ColumnElement[str], settings: OutboxSettings | None) -> ColumnElement[str]:
    """A select-list item that NOTIFYs the runs channel with *workflow* (fires at commit)."""
    return func.pg_notify(literal(channel(settings)), workflow).label("notified")


def woken(settings: OutboxSettings | None) -> Callable[[CTE], ColumnElement[Any]]:
    """:func:`notify` for a fenced write (:func:`outbox.runs.fencing.statement`'s ``woken``)."""
    return lambda moved: notify(moved.c.workflow, settings)

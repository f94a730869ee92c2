"""Rows a handler asked to insert later: ``ctx.defer_insert``, written together per batch.

A per-message handler that writes its row with ``ctx.conn.execute`` waits for PostgreSQL
once per message. One that calls ``ctx.defer_insert(table, row)`` instead hands the row
over; in batch mode the consumer writes the batch's rows of each table (and set of
columns) in one ``INSERT`` (:func:`outbox.db.bulk.insert_rows`: a literal per column where
the types allow), after the batch's handlers ran and before its commit. The handler gets no
result and no row count, its later statements do not see the row, and an error in the row
(a unique violation, say) is raised when the rows are written, not at the call: the
consumer then rolls the batch back and handles it again message by message, each in a
savepoint with its own rows written at its end, so the error is charged to the message
whose row caused it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, TableClause

from outbox.db.bulk import insert_rows

_Group = tuple[TableClause, tuple[str, ...]]


class DeferredInserts:
    """The rows deferred in one transaction (or savepoint), by table and columns, in order."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[_Group, list[Mapping[str, Any]]] = {}

    def add(self, table: TableClause, row: Mapping[str, Any]) -> None:
        group = (table, tuple(row))
        rows = self._rows.get(group)
        if rows is None:
            self._rows[group] = [row]
        else:
            rows.append(row)

    def write(self, conn: Connection) -> None:
        """Insert every row kept so far on *conn*: one statement per table and columns.

        Tables in the order their first row was deferred, rows in the order given. An error
        names the table and says the rows were deferred (the traceback shows this call, not
        the handler's).
        """
        groups, self._rows = self._rows, {}
        for (table, _), rows in groups.items():
            try:
                insert_rows(conn, table, rows)
            except Exception as exc:
                exc.add_note(
                    f"raised writing {len(rows)} row(s) deferred with ctx.defer_insert into "
                    f"{table.name!r}"
                )
                raise

    def discard(self) -> None:
        """Forget the rows kept so far (their transaction or savepoint rolls back)."""
        self._rows = {}

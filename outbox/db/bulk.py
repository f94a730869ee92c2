"""Many rows of one table in one ``INSERT ... SELECT * FROM unnest(...)``, a literal per column.

SQLAlchemy's multi-row ``INSERT`` binds every value (psycopg dumps each in Python) and
PostgreSQL parses a statement as long as the rows: measured on 500 rows of a text and an
integer, 11 µs of the client's CPU and 8 µs of PostgreSQL's per row, against 0.5 and 3.5
with each column's values sent as one array literal (:mod:`outbox.db.arrays`, made by joins).

Used only where PostgreSQL then stores what SQLAlchemy's statement would have stored, with
the same errors:
- a column whose type SQLAlchemy's psycopg dialect sends with a cast (``VARCHAR``,
  ``INTEGER``, ``BIGINT``, ``SMALLINT``: the text and integer types), values exactly
  ``str`` or ``int``: the array gets the same cast;
- a plain ``Boolean``, values exactly ``bool``;
- an untyped column (``sqlalchemy.column("name")``): SQLAlchemy sends a string untyped and
  PostgreSQL reads it with the column's own type, as reading each element of an array of
  that type does; so strings for any column that is not an array, integers for a numeric
  column, booleans for a boolean one. The column types are read from the catalog once per
  table and process (a column whose type changes under a running process is seen after a
  restart).
Anything else (another type, a ``TypeDecorator``, a ``str`` subclass such as a ``StrEnum``,
an ``int`` for a text column) goes SQLAlchemy's way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    BOOLEAN,
    Boolean,
    Connection,
    TableClause,
    TextClause,
    bindparam,
    insert,
    text,
)
from sqlalchemy.sql.sqltypes import NullType

from outbox.db.arrays import int_array, text_array

_NONE = type(None)
# Each type as SQLAlchemy's psycopg dialect casts its bind parameter, and the values it takes.
_CASTS = {"VARCHAR": str, "INTEGER": int, "BIGINT": int, "SMALLINT": int}
# An untyped column's PostgreSQL type category: the Python types its literal may hold.
_CATEGORIES = {"N": frozenset((str, int)), "B": frozenset((str, bool))}


def insert_rows(conn: Connection, table: TableClause, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert *rows* (each with the same keys, in the same order) into *table*, in order.

    Raises ValueError for a key that is not one of *table*'s columns (SQLAlchemy's
    statement would drop its value without a word).
    """
    columns = tuple(rows[0]) if rows else ()
    plan = _plan_for(conn, table, columns)
    parameters = plan.parameters(rows) if plan else None
    if plan and parameters is not None:
        conn.execute(plan.statement, parameters)
    else:
        conn.execute(insert(table), list(rows))


def check_columns(table: TableClause, row: Mapping[str, Any]) -> None:
    """Raise ValueError for a key of *row* that is not one of *table*'s columns."""
    for key in row:
        if table.c.get(key) is None:
            raise ValueError(f"table {table.name!r} has no column {key!r}")


class _Unnested:
    __slots__ = ("_columns", "statement")

    def __init__(self, statement: TextClause, columns: list[tuple[str, frozenset[type]]]):
        self.statement = statement
        self._columns = columns  # (name, the Python types its values may have)

    def parameters(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, str] | None:
        """Each column's values as one array literal; None if one does not fit its column."""
        out = {}
        for i, (name, allowed) in enumerate(self._columns):
            values = [row[name] for row in rows]
            kinds = set(map(type, values))
            kinds.discard(_NONE)
            if len(kinds) > 1 or not kinds <= allowed:
                return None
            out[f"c{i}"] = _LITERALS[kinds.pop() if kinds else str](values)
        return out


def _bool_array(values: Sequence[bool | None]) -> str:
    return "{" + ",".join(["NULL" if v is None else "t" if v else "f" for v in values]) + "}"


_LITERALS: dict[type, Callable[[Any], str]] = {str: text_array, int: int_array, bool: _bool_array}

_plans: dict[tuple[Any, ...], _Unnested | None] = {}


def _plan_for(conn: Connection, table: TableClause, columns: tuple[str, ...]) -> _Unnested | None:
    """The statement for *table*'s *columns*, made once per process and database."""
    check_columns(table, dict.fromkeys(columns))
    if table.schema in (conn.get_execution_options().get("schema_translate_map") or {}):
        return None  # the schema is renamed per execution: SQLAlchemy's way renames it
    key = (table, columns, conn.engine.url)
    if key not in _plans:
        if len(_plans) > 1000:  # tables made per call would grow it without end
            _plans.clear()
        _plans[key] = _plan(conn, table, columns)
    return _plans[key]


def _plan(conn: Connection, table: TableClause, columns: tuple[str, ...]) -> _Unnested | None:
    if not columns:  # an empty row: SQLAlchemy's way sends DEFAULT VALUES
        return None
    dialect = conn.dialect
    preparer = dialect.identifier_preparer
    target = preparer.format_table(table)
    catalog: dict[str, tuple[str, str]] | None = None
    casts: list[str] = []
    described: list[tuple[str, frozenset[type]]] = []
    for i, key in enumerate(columns):
        column = table.c[key]
        if column.name != key:  # a Column(key=...): SQLAlchemy's way maps it
            return None
        if isinstance(column.type, NullType):
            if catalog is None:
                catalog = _column_types(conn, target)
            if key not in catalog or catalog[key][1] == "A":  # absent, or an array
                return None
            cast, category = catalog[key]
            allowed = _CATEGORIES.get(category, frozenset((str,)))
        elif type(column.type) in (Boolean, BOOLEAN):
            cast, allowed = "BOOLEAN", frozenset((bool,))
        else:
            bound = str(bindparam("v", type_=column.type).compile(dialect=dialect))
            cast = bound.rpartition("::")[2]
            processor = column.type.dialect_impl(dialect).bind_processor(dialect)
            if "::" not in bound or cast not in _CASTS or processor:
                return None
            allowed = frozenset((_CASTS[cast],))
        casts.append(f"CAST(:c{i} AS {_escaped(cast)}[])")
        described.append((key, allowed))
    names = ", ".join(preparer.quote(c) for c in columns)
    statement = text(f"INSERT INTO {_escaped(target)} ({_escaped(names)}) "
                     f"SELECT * FROM unnest({', '.join(casts)})")
    return _Unnested(statement, described)


def _escaped(sql: str) -> str:
    """A colon in a quoted name must not read as a bind parameter."""
    return sql.replace(":", "\\:")


def _column_types(conn: Connection, target: str) -> dict[str, tuple[str, str]]:
    """Each column of *target* (a quoted name): its type without modifier, its category.

    The type by its schema and internal name: ``pg_catalog.bpchar``, not ``character``,
    which SQL's grammar reads as ``character(1)`` (and ``bit`` as ``bit(1)``).
    """
    rows = conn.execute(text(
        "SELECT a.attname, format('%I.%I', n.nspname, t.typname), t.typcategory"
        " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
        " JOIN pg_namespace n ON n.oid = t.typnamespace"
        " WHERE a.attrelid = to_regclass(:target) AND a.attnum > 0 AND NOT a.attisdropped"
    ), {"target": target})
    return {name: (cast, category) for name, cast, category in rows}

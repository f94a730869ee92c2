"""Many rows of one table in one ``INSERT ... SELECT * FROM unnest(...)``, a literal per column.

SQLAlchemy's multi-row ``INSERT`` binds every value (psycopg dumps each in Python) and
PostgreSQL parses a statement as long as the rows: measured on 500 rows of a text and an
integer, 11 µs of the client's CPU and 8 µs of PostgreSQL's per row, against 0.5 and 3.5
with each column's values sent as one array literal (:mod:`outbox.db.arrays`, made by joins).

Used only where PostgreSQL then stores what SQLAlchemy's statement would have stored, with
the same errors. Each column's array is cast the way that statement's parameter would have
been typed: first as psycopg sends a value of its Python type (``bool``, ``int``, ``float``,
``Decimal``, ``datetime`` naive or aware, ``date``, ``UUID``; a ``str`` goes untyped), then
with the cast SQLAlchemy's psycopg dialect writes for the column's type (``VARCHAR``,
``INTEGER``, ``UUID``, ``TIMESTAMP WITH TIME ZONE``, ...), and the ``INSERT`` assigns the
result to the column as it would have assigned the parameter. An untyped string for an
untyped column (``sqlalchemy.column("name")``) is read by the column's own type, as
PostgreSQL reads an untyped parameter there: that type is read from the catalog once per
table and process (a column whose type changes under a running process is seen after a
restart).

The values of one column must all be of one such type, exactly (or None), and one the
column's declared type takes: ``str`` for text types, ``int`` for integer types, ``str``
or ``UUID`` for ``Uuid``, ``datetime``, ``date`` or ``str`` for ``DateTime`` and ``Date``,
``bool`` for a plain ``Boolean``, ``int``, ``float`` or ``Decimal`` for ``Numeric`` and
``Float``, and any of them for an untyped column that is not an array. Anything else (JSON,
a ``TypeDecorator``, a ``str`` subclass such as a ``StrEnum``, a ``bool`` for an integer
column, a NaN ``Decimal``) goes SQLAlchemy's way.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any, NamedTuple

from sqlalchemy import (
    BOOLEAN,
    Boolean,
    Connection,
    Float,
    Numeric,
    TableClause,
    TextClause,
    bindparam,
    insert,
    text,
)
from sqlalchemy.sql.sqltypes import NullType

from outbox.db.arrays import int_array, text_array

_NONE = type(None)
_INT8 = 2**63
# SQLAlchemy's casts of a bind parameter that this module repeats, and the values they take.
_CASTS: dict[str, frozenset[type]] = {
    "VARCHAR": frozenset((str,)),
    "INTEGER": frozenset((int,)), "BIGINT": frozenset((int,)), "SMALLINT": frozenset((int,)),
    "UUID": frozenset((str, uuid.UUID)),
    "TIMESTAMP WITHOUT TIME ZONE": frozenset((datetime, date, str)),
    "TIMESTAMP WITH TIME ZONE": frozenset((datetime, date, str)),
    "DATE": frozenset((date, datetime, str)),
}
_ANY = frozenset((str, int, bool, float, Decimal, datetime, date, uuid.UUID))


def insert_rows(conn: Connection, table: TableClause, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert *rows* (each with the same keys, in the same order) into *table*, in order.

    Raises ValueError for a key that is not one of *table*'s columns (SQLAlchemy's
    statement would drop its value without a word).
    """
    columns = tuple(rows[0]) if rows else ()
    plan = _plan_for(conn, table, columns)
    bound = plan.bind(rows) if plan else None
    if bound is not None:
        conn.execute(*bound)
    else:
        conn.execute(insert(table), list(rows))


def _check_columns(table: TableClause, columns: tuple[str, ...]) -> None:
    """Raise ValueError for a name in *columns* that is not one of *table*'s columns."""
    for key in columns:
        if table.c.get(key) is None:
            raise ValueError(f"table {table.name!r} has no column {key!r}")


class _Column(NamedTuple):
    name: str
    cast: str | None  # SQLAlchemy's cast of the parameter, or None
    own: str | None  # an untyped column's own type: how PostgreSQL reads an untyped string
    allowed: frozenset[type]
    null_as: str  # the array's type when every value is None


class _Unnested:
    __slots__ = ("_columns", "_head", "_statements")

    def __init__(self, head: str, columns: list[_Column]):
        self._head = head  # INSERT INTO table (columns)
        self._columns = columns
        self._statements: dict[tuple[str | None, ...], TextClause] = {}

    def bind(self, rows: Sequence[Mapping[str, Any]]) -> tuple[TextClause, dict[str, str]] | None:
        """The statement for these *rows* and its parameters; None if a value does not fit."""
        out = {}
        sent: list[str | None] = []
        for i, column in enumerate(self._columns):
            values = [row[column.name] for row in rows]
            kinds = set(map(type, values))
            kinds.discard(_NONE)
            if len(kinds) > 1 or not kinds <= column.allowed:
                return None
            kind = kinds.pop() if kinds else None
            as_sent = _sent_as(kind, values, column)
            if as_sent == "":
                return None
            sent.append(as_sent)
            out[f"c{i}"] = (int_array(values) if kind is int else
                            _bool_array(values) if kind is bool else
                            text_array(values) if kind is str or kind is None else
                            text_array([None if v is None else str(v) for v in values]))
        shape = tuple(sent)
        statement = self._statements.get(shape)
        if statement is None:
            statement = self._statements[shape] = self._statement(shape)
        return statement, out

    def _statement(self, shape: tuple[str | None, ...]) -> TextClause:
        arrays = []
        for i, (column, sent) in enumerate(zip(self._columns, shape, strict=True)):
            if sent is None:  # untyped: read as the cast, or as the column's own type
                arrays.append(f"CAST(:c{i} AS {_escaped(column.cast or column.own or '')}[])")
            elif column.cast is None:
                arrays.append(f"CAST(:c{i} AS {sent}[])")
            else:
                arrays.append(f"CAST(CAST(:c{i} AS {sent}[]) AS {column.cast}[])")
        return text(f"{self._head} SELECT * FROM unnest({', '.join(arrays)})")


def _sent_as(kind: type | None, values: list[Any], column: _Column) -> str | None:
    """The type psycopg would send *values* as (None: untyped, read as the cast or the
    column's own type); "" when they cannot go this way."""
    if kind is None:  # every value None
        return None if column.cast or column.own else column.null_as
    if kind is str or (kind is int and column.cast):
        return None  # (an integer: psycopg's, then the integer cast: read as that at once)
    present = [v for v in values if v is not None]
    sent = _SENT[kind]
    if kind is int and not all(-_INT8 <= v < _INT8 for v in present):
        sent = "numeric"
    elif kind is datetime:
        naive = {v.tzinfo is None for v in present}
        sent = "" if len(naive) > 1 else "timestamp" if naive == {True} else "timestamptz"
    elif kind is Decimal and not all(v.is_finite() for v in present):
        sent = ""  # psycopg's way with NaN and infinities is its own
    return sent


_SENT: dict[type, str] = {int: "int8", bool: "boolean", float: "float8", Decimal: "numeric",
                          datetime: "timestamptz", date: "date", uuid.UUID: "uuid"}


def _bool_array(values: Sequence[bool | None]) -> str:
    return "{" + ",".join(["NULL" if v is None else "t" if v else "f" for v in values]) + "}"


_plans: dict[tuple[Any, ...], _Unnested | None] = {}


def _plan_for(conn: Connection, table: TableClause, columns: tuple[str, ...]) -> _Unnested | None:
    """The statements for *table*'s *columns*, made once per process and database."""
    _check_columns(table, columns)
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
    described: list[_Column] = []
    for key in columns:
        column = table.c[key]
        if column.name != key:  # a Column(key=...): SQLAlchemy's way maps it
            return None
        type_ = column.type
        if isinstance(type_, NullType):
            if catalog is None:
                catalog = _column_types(conn, target)
            if key not in catalog or catalog[key][1] == "A":  # absent, or an array
                return None
            described.append(_Column(key, None, catalog[key][0], _ANY, "text"))
            continue
        bound = str(bindparam("v", type_=type_).compile(dialect=dialect))
        cast = bound.rpartition("::")[2] if "::" in bound else None
        if type(type_) in (Boolean, BOOLEAN):  # its processor only refuses non-booleans
            described.append(_Column(key, None, None, frozenset((bool,)), "boolean"))
        elif type_.dialect_impl(dialect).bind_processor(dialect) is not None:
            return None
        elif cast in _CASTS:
            described.append(_Column(key, cast, None, _CASTS[cast], cast))
        elif cast is None and isinstance(type_, (Numeric, Float)):
            described.append(_Column(key, None, None, frozenset((int, float, Decimal)),
                                     "numeric"))
        else:
            return None
    names = ", ".join(preparer.quote(c) for c in columns)
    return _Unnested(f"INSERT INTO {_escaped(target)} ({_escaped(names)})", described)


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

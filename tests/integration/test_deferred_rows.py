"""Deferred rows on real PostgreSQL: the array-literal statement writes what SQLAlchemy's would.

``DeferredInserts.write`` sends a batch's rows of a table as one ``INSERT ... unnest`` of
array literals where the column types and values allow it, else SQLAlchemy's multi-row
``INSERT``. Each case here writes the same rows both ways into two tables of the same
definition and compares what PostgreSQL holds, or the error each way raised; and checks
which statement went, so that a fast path quietly turned off fails too.
"""

from __future__ import annotations

import contextlib
import enum
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Engine,
    Float,
    Integer,
    MetaData,
    Numeric,
    SmallInteger,
    String,
    Table,
    TableClause,
    Text,
    TypeDecorator,
    Uuid,
    column,
    event,
    insert,
    table,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import DBAPIError

from consumers.deferred import DeferredInserts


class Upper(TypeDecorator[str]):
    """A type that changes the value on its way in: only SQLAlchemy's way applies it."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return None if value is None else value.upper()


class Colour(enum.StrEnum):
    RED = "red"


def twins(*columns: tuple[str, Any], name: str = "rows") -> tuple[Table, Table]:
    """The same table twice: one written the fast way, one SQLAlchemy's way."""
    metadata = MetaData(schema="public")
    fast, plain = (
        Table(f"{name}_{way}", metadata, Column("seq", Integer, primary_key=True),
              *(Column(n, t) for n, t in columns))
        for way in ("deferred", "plain"))
    return fast, plain


WIDE = twins(
    ("s", String(8)), ("t", Text), ("i", Integer), ("b", BigInteger), ("h", SmallInteger),
    ("f", Boolean),
)


@pytest.fixture(autouse=True)
def _zone(engine: Engine) -> None:
    """Sessions in a time zone that is not UTC, where naive and aware datetimes differ."""
    with engine.begin() as conn:
        name = conn.execute(text("SELECT current_database()")).scalar()
        conn.execute(text(f"ALTER DATABASE \"{name}\" SET TimeZone = 'Asia/Kolkata'"))
    engine.dispose()


@contextlib.contextmanager
def sent_statements(engine: Engine, prefix: str) -> Iterator[list[str]]:
    """Every statement sent on *engine* that starts with *prefix* (upper case), as sent."""
    sent: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(prefix):
            sent.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", seen)


@pytest.fixture
def statements(engine: Engine) -> Iterator[list[str]]:
    with sent_statements(engine, "INSERT") as sent:
        yield sent


def both_ways(engine: Engine, pair: tuple[Table, Table], rows: list[dict[str, Any]]) -> Any:
    """Write *rows* both ways; (the fast table's rows, the plain one's) or the two errors."""
    fast, plain = pair
    with engine.begin() as conn:
        pair[0].metadata.create_all(conn, tables=list(pair))
    results: list[Any] = []
    for target, write in ((fast, _deferred), (plain, _plain)):
        try:
            with engine.begin() as conn:
                write(conn, target, rows)
            with engine.connect() as conn:
                names = [c.name for c in target.c if c.name != "seq"]
                got = conn.execute(target.select().order_by(target.c.seq)).mappings()
                results.append([{k: r[k] for k in names} for r in got])
        except DBAPIError as exc:
            results.append(type(exc.orig))
    return results


def _deferred(conn: Any, target: TableClause, rows: list[dict[str, Any]]) -> None:
    deferred = DeferredInserts()
    for row in rows:
        deferred.add(target, row)
    deferred.write(conn)


def _plain(conn: Any, target: TableClause, rows: list[dict[str, Any]]) -> None:
    conn.execute(insert(target), rows)


def unnested(statements: list[str]) -> list[bool]:
    return ["unnest(" in s for s in statements]


AWKWARD = ['a,b', '{x}', '"q"', "back\\slash", "NULL", "null", " pad ", "", "été ☃", "a\"\\b"]


def test_text_integers_and_booleans_of_every_shape_go_as_arrays_and_land_the_same(
    engine: Engine, statements: list[str]
) -> None:
    rows = [
        {"s": s[:8], "t": s * 3, "i": -i, "b": 2**62 + i, "h": i, "f": i % 2 == 0}
        for i, s in enumerate(AWKWARD)
    ]
    rows.append({"s": None, "t": None, "i": None, "b": None, "h": None, "f": None})
    fast, plain = both_ways(engine, WIDE, rows)
    assert fast == plain
    assert fast[0] == {"s": "a,b", "t": "a,ba,ba,b", "i": 0, "b": 2**62, "h": 0, "f": True}
    assert unnested(statements) == [True, False]


def test_rows_keep_the_order_they_were_deferred_in(engine: Engine, statements: list[str]) -> None:
    rows = [{"s": str(n), "t": "x", "i": n, "b": n, "h": 1, "f": True}
            for n in (5, 3, 9, 1, 7)]
    fast, plain = both_ways(engine, WIDE, rows)
    assert [r["i"] for r in fast] == [5, 3, 9, 1, 7] == [r["i"] for r in plain]
    assert unnested(statements) == [True, False]


@pytest.mark.parametrize(
    ("row", "error"),
    [
        ({"s": "nine chars"}, "StringDataRightTruncation"),  # String(8): refused, not cut
        ({"i": 2**31}, "NumericValueOutOfRange"),  # Integer's cast, as SQLAlchemy sends it
        ({"h": 2**15}, "NumericValueOutOfRange"),
        ({"t": "nul\x00"}, "DataError"),
    ],
    ids=["too-long", "integer-range", "smallint-range", "nul"],
)
def test_a_bad_value_is_refused_both_ways_and_nothing_of_the_batch_lands(
    engine: Engine, statements: list[str], row: dict[str, Any], error: str
) -> None:
    good = {"s": "ok", "t": "ok", "i": 1, "b": 1, "h": 1, "f": False}
    fast, plain = both_ways(engine, WIDE, [good, {**good, **row}])
    assert isinstance(fast, type), fast
    assert fast is plain
    assert error in [c.__name__ for c in fast.__mro__]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM public.rows_deferred")).scalar() == 0


TYPED = twins(
    ("u", Uuid), ("tz", DateTime(timezone=True)), ("ts", DateTime), ("d", Date),
    ("n", Numeric(10, 2)), ("x", Float), name="typed_more",
)


@pytest.mark.parametrize(
    "columns",
    [
        {"u": [uuid.UUID(int=5), None], "tz": [datetime(2026, 12, 6, 1, tzinfo=UTC), None],
         "ts": [datetime(2026, 12, 6, 1, 2, 3, 4), None], "d": [date(2026, 12, 6), None],
         "n": [Decimal("1.005"), None], "x": [0.1, None]},
        {"u": ["00000000-0000-0000-0000-000000000009", None],  # strings, read by the casts
         "tz": ["2026-12-06 01:00+02", None], "ts": ["2026-12-06", None], "d": ["today", None]},
        {"tz": [datetime(2026, 12, 6, 1), None],  # naive for timestamptz: the session's zone
         "ts": [datetime(2026, 12, 6, 1, tzinfo=timezone(timedelta(hours=3))), None],
         "d": [datetime(2026, 12, 6, 23, 30, tzinfo=timezone(timedelta(hours=-3))), None]},
        {"tz": [date(2026, 12, 6), None], "ts": [date(2026, 12, 6), None]},
        {"n": [7, 2**70], "x": [2**70, None]},  # integers; 2**70 is too big for (10,2)
        {"n": [7, None], "x": [Decimal("2.5"), 1.5]},  # two kinds: SQLAlchemy's way
        {"n": [12345678901.0, None]},  # too big for (10,2)
        {"u": ["not a uuid", None]},
    ],
    ids=["values", "strings", "zones", "dates-for-timestamps", "integers", "mixed", "overflow",
         "bad-uuid"],
)
def test_uuid_time_and_number_columns_take_their_values_as_sqlalchemy_s_way_does(
    engine: Engine, statements: list[str], columns: dict[str, list[Any]]
) -> None:
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(),
                                                                         strict=True)]
    fast, plain = both_ways(engine, TYPED, rows)
    assert fast == plain
    mixed = any(len({type(v) for v in vs} - {type(None)}) > 1 for vs in columns.values())
    assert unnested(statements) == [not mixed, False]


@pytest.mark.parametrize(
    "rows",
    [
        [{"i": 1}, {"i": "2"}],  # a str for an integer column: SQLAlchemy's cast takes it
        [{"i": 1}, {"i": True}],  # a bool is an int in Python, not in PostgreSQL
        [{"s": "a"}, {"s": Colour.RED}],  # a str subclass: psycopg dumps it its own way
        [{"f": True}, {"f": 1}],
    ],
    ids=["str-for-int", "bool-for-int", "str-enum", "int-for-bool"],
)
def test_values_not_of_the_column_s_exact_type_go_sqlalchemy_s_way(
    engine: Engine, statements: list[str], rows: list[dict[str, Any]]
) -> None:
    pair = twins(("s", String(8)), ("i", Integer), ("f", Boolean), name="odd")
    full = [{"s": "x", "i": 0, "f": False, **r} for r in rows]
    fast, plain = both_ways(engine, pair, full)
    assert fast == plain
    assert unnested(statements) == [False, False]


def test_types_it_does_not_know_go_sqlalchemy_s_way(
    engine: Engine, statements: list[str]
) -> None:
    pair = twins(("u", Upper), ("j", JSONB), name="typed")
    fast, plain = both_ways(engine, pair, [{"u": "a", "j": {"k": [1]}}, {"u": "b", "j": None}])
    assert fast == plain == [{"u": "A", "j": {"k": [1]}}, {"u": "B", "j": None}]
    assert unnested(statements) == [False, False]


UNTYPED = ("d date, j jsonb, u uuid, v varchar(3), c char(2), n numeric(6,2), i int,"
           " f boolean, e mood, a int[], b bit(3), t timestamptz, x float8, s text")


def untyped_twins(engine: Engine) -> tuple[TableClause, TableClause]:
    """Two tables of every kind of column, seen through ``sqlalchemy.table`` untyped."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TYPE public.mood AS ENUM ('calm', 'busy')"))
        for way in ("deferred", "plain"):
            conn.execute(text(f"CREATE TABLE public.loose_{way} (seq serial, {UNTYPED})"))
    names = [c.split()[0] for c in UNTYPED.split(", ")]
    fast, plain = (table(f"loose_{way}", *map(column, names), schema="public")
                   for way in ("deferred", "plain"))
    return fast, plain


def written(engine: Engine, target: TableClause, rows: list[dict[str, Any]]) -> Any:
    """*rows* deferred into *target*, read back as text; or the error's class."""
    try:
        with engine.begin() as conn:
            (_deferred if target.name.endswith("deferred") else _plain)(conn, target, rows)
    except DBAPIError as exc:
        return type(exc.orig)
    with engine.connect() as conn:
        return conn.execute(text(
            f"SELECT {', '.join(c + '::text' for c in target.c.keys())}"  # noqa: SIM118
            f" FROM public.{target.name} ORDER BY seq")).all()


@pytest.mark.parametrize(
    ("columns", "fast"),
    [
        ({"d": ["2026-12-06", None], "j": ['{"a": [1, "x,y"]}', "null"],
          "u": ["0191f6a0-0000-7000-8000-000000000001", None], "v": ["abc", ""],
          "c": ["a", "bb"], "n": ["12.345", "1e2"], "e": ["calm", "busy"],
          "b": ["101", "000"], "t": ["2026-12-06 12:00:00+01", "infinity"]}, True),
        ({"c": ["abc", "a"]}, True),  # too long for char(2) both ways
        ({"b": ["1", "101"]}, True),  # not 3 bits: refused both ways
        ({"n": [5, None], "i": [-7, 2**31 - 1], "f": [True, None]}, True),
        ({"i": ["8", "09"], "f": ["yes", "off"]}, True),  # strings read by the column's type
        ({"v": ["abcd", "ok"]}, True),  # too long for varchar(3): refused both ways
        ({"i": [2**31, 1]}, True),  # out of range both ways
        ({"e": ["calm", "sad"]}, True),  # not a label of the enum
        ({"v": [1, 22]}, True),  # an int for a text column: assigned as psycopg's int
        ({"i": [True, False]}, True),  # a bool for an integer column: refused both ways
        ({"f": [1, 0]}, True),  # an int for a boolean column: refused both ways
        ({"n": [2**70, 1]}, True),  # past int8: sent as numeric, too big for (6,2)
        ({"s": [2**70, -(2**63)], "x": [2**64, 1]}, True),  # past int8, landing
        ({"n": [1.25, float("nan")], "x": [float("-inf"), 1e300], "s": [0.1, None]}, True),
        ({"n": [Decimal("12.345"), Decimal("-0")], "v": [Decimal("1E+2"), None]}, True),
        ({"n": [Decimal("NaN"), Decimal(1)]}, False),  # psycopg's own way with NaN
        ({"t": [datetime(2026, 12, 6, 12, 30, 1, 5, tzinfo=UTC), None],
          "d": [datetime(2026, 12, 6, 23, 59, tzinfo=timezone(timedelta(hours=-5))), None]},
         True),  # aware datetimes for timestamptz and date (the session's zone decides)
        ({"t": [datetime(2026, 12, 6, 12, 30), datetime(1, 1, 1)],
          "s": [datetime(2026, 1, 2), None]}, True),  # naive: timestamp, text
        ({"t": [datetime(2026, 12, 6), datetime(2026, 12, 6, tzinfo=UTC)]}, False),  # mixed
        ({"d": [date(2026, 12, 6), date(1, 1, 1)], "t": [date(2026, 12, 6), None]}, True),
        ({"u": [uuid.UUID(int=7), None], "v": [uuid.UUID(int=1), None]}, True),  # too long
        ({"u": [uuid.UUID(int=7), None], "s": [uuid.UUID(int=1), None]}, True),
        ({"j": [uuid.UUID(int=1), None]}, True),  # uuid to jsonb: no cast, refused both ways
        ({"a": ["{1,2}", "{}"]}, False),  # an array column
        ({"i": [1, "2"]}, False),  # two kinds in one column
        ({"j": [{"a": 1}, None]}, False),  # a dict: psycopg cannot send it untyped either
    ],
    ids=["strings", "char-too-long", "bits", "numbers", "strings-for-numbers", "too-long",
         "range", "enum", "int-for-text", "bool-for-int", "int-for-bool", "past-int8",
         "past-int8-landing", "floats", "decimals", "decimal-nan", "aware", "naive",
         "mixed-zones", "dates", "uuid-for-text", "uuids", "uuid-for-json", "array", "mixed",
         "dict"],
)
def test_untyped_columns_are_read_by_postgresql_s_own_types_as_sqlalchemy_s_way_is(
    engine: Engine, statements: list[str], columns: dict[str, list[Any]], fast: bool
) -> None:
    rows = [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(),
                                                                         strict=True)]
    deferred, plain = untyped_twins(engine)
    assert written(engine, deferred, rows) == written(engine, plain, rows)
    assert unnested(statements) == [fast, False]


def test_empty_rows_take_every_default(engine: Engine, statements: list[str]) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.defaults (n int DEFAULT 7)"))
        _deferred(conn, table("defaults", column("n"), schema="public"), [{}, {}])
        assert conn.execute(text("SELECT n FROM public.defaults")).scalars().all() == [7, 7]
    assert unnested(statements) == [False]


def test_names_with_colons_quotes_and_capitals(engine: Engine, statements: list[str]) -> None:
    metadata = MetaData(schema="public")
    odd = Table("we:ird \"T\"", metadata, Column("a:b", Text), Column("Sel ect", Integer))
    with engine.begin() as conn:
        metadata.create_all(conn)
        _deferred(conn, odd, [{"a:b": ":x", "Sel ect": 1}, {"a:b": "y", "Sel ect": 2}])
    with engine.connect() as conn:
        assert conn.execute(odd.select()).all() == [(":x", 1), ("y", 2)]
    assert unnested(statements) == [True]


def test_a_schema_renamed_per_execution_is_renamed_for_deferred_rows_too(
    engine: Engine, statements: list[str]
) -> None:
    aliased = Table("renamed", MetaData(schema="alias"), Column("n", Integer))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE public.renamed (n int)"))
    translated = engine.execution_options(schema_translate_map={"alias": "public"})
    with translated.begin() as conn:
        _deferred(conn, aliased, [{"n": 1}, {"n": 2}])
    with engine.connect() as conn:
        assert conn.execute(text("SELECT n FROM public.renamed")).scalars().all() == [1, 2]
    assert unnested(statements) == [False]


def test_a_key_that_is_not_a_column_is_named_in_the_error(engine: Engine) -> None:
    (fast, _) = WIDE
    with engine.begin() as conn:
        WIDE[0].metadata.create_all(conn, tables=[fast])
    with engine.begin() as conn, pytest.raises(Exception, match="nope") as raised:
        _deferred(conn, fast, [{"i": 1, "nope": 2}])
    assert raised.value.__notes__ == [
        "raised writing 1 row(s) deferred with ctx.defer_insert into 'rows_deferred'"]

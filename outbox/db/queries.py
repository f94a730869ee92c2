"""Hand-written SQL: named queries in each package's ``queries.sql``, one loader, one quoting rule.

Statements that SQLAlchemy Core cannot say as well (the relay's claim, emit's one-round-trip
INSERT, the inbox marks...) live as SQL in a ``queries.sql`` next to the package that runs
them, each under a marker line::

    -- name: claim_messages
    -- The comment lines right after the marker describe the query: they are documentation,
    -- left out of the statement sent, as are the comments and indentation inside it.
    SELECT ...

``{schema}`` in a query stands for the configured schema. It is replaced by
:func:`quote_identifier`, the rule SQLAlchemy applies to the Core tables through
``schema_translate_map``, so both kinds of statement name the same schema. Values always
travel as bound parameters: ``:name`` for a query run as :func:`sql` (a ``TextClause``),
``%(name)s`` / ``%(name)b`` for one run with ``exec_driver_sql`` (:func:`driver_sql`), which
hot paths use to skip SQLAlchemy's compilation. A file is read once (with
:mod:`importlib.resources`, so an installed wheel works the same) and each rendering is
cached per (package, name, schema).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a TextClause is made: the relay runs without SQLAlchemy
    from sqlalchemy import TextClause

QUERY_FILE = "queries.sql"

_MARKER = re.compile(r"^-- name: (?P<name>\S+)[ \t]*$", re.MULTILINE)
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# PostgreSQL's keywords that may not stand bare as every identifier (pg_get_keywords(),
# catcode R, T or C, of PostgreSQL 15; tests/integration/test_named_queries.py checks the
# server's list). A name among them is quoted.
_KEYWORDS = frozenset("""
    all analyse analyze and any array as asc asymmetric authorization between bigint binary
    bit boolean both case cast char character check coalesce collate collation column
    concurrently constraint create cross current_catalog current_date current_role
    current_schema current_time current_timestamp current_user dec decimal default
    deferrable desc distinct do else end except exists extract false fetch float for foreign
    freeze from full grant greatest group grouping having ilike in initially inner inout int
    integer intersect interval into is isnull join lateral leading least left like limit
    localtime localtimestamp national natural nchar none normalize not notnull null nullif
    numeric offset on only or order out outer overlaps overlay placing position precision
    primary real references returning right row select session_user setof similar smallint
    some substring symmetric table tablesample then time timestamp to trailing treat trim
    true union unique user using values varchar variadic verbose when where window with
    xmlattributes xmlconcat xmlelement xmlexists xmlforest xmlnamespaces xmlparse xmlpi
    xmlroot xmlserialize xmltable
""".split())  # noqa: SIM905 - 151 words read better as text
_BARE = re.compile(r"^[a-z_][a-z0-9_$]*$")


def quote_identifier(name: str) -> str:
    """*name* as a PostgreSQL identifier, quoted only when it has to be: a name with capitals
    (unquoted, PostgreSQL would fold them), other characters, or a keyword. Core quotes the
    same names, and a few more keywords; either spelling names the same schema."""
    if _BARE.match(name) and name not in _KEYWORDS:
        return name
    return '"' + name.replace('"', '""') + '"'


_MAX_IDENTIFIER = 63  # PostgreSQL truncates (LISTEN) or refuses (pg_notify) longer names


def runs_channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of the runs in *schema* (``<schema>_runs``;
    :mod:`outbox.runs.wakeups`)."""
    name = f"{schema}_runs"
    if len(name) > _MAX_IDENTIFIER:
        # Long schema names: a digest keeps two such schemas on different channels.
        digest = hashlib.sha256(schema.encode()).hexdigest()[:8]
        name = f"{schema[:_MAX_IDENTIFIER - 14]}_{digest}_runs"
    return name


def parse(source: str, origin: str) -> dict[str, str]:
    """The queries of one file's *source*, by name; *origin* names the file in errors."""
    pieces = _MARKER.split(source)
    if pieces[0].strip() and not all(
        line.startswith("--") or not line.strip() for line in pieces[0].splitlines()
    ):
        raise ValueError(f"{origin}: SQL before the first '-- name:' marker; give it a name")
    found: dict[str, str] = {}
    for name, body in zip(pieces[1::2], pieces[2::2], strict=True):
        if not _NAME.match(name):
            raise ValueError(f"{origin}: query name {name!r} is not lower_case_with_underscores")
        if name in found:
            raise ValueError(f"{origin}: two queries are named {name!r}; rename one")
        lines = body.strip().splitlines()
        while lines and lines[0].startswith("--"):
            del lines[0]
        if not "".join(lines).strip():
            raise ValueError(f"{origin}: query {name!r} is empty")
        if _plain(lines):
            found[name] = "\n".join(filter(None, map(_compact, lines))) + "\n"
        else:  # what _compact cannot read safely is sent as written
            found[name] = "\n".join(lines).strip() + "\n"
    return found


def _plain(lines: list[str]) -> bool:
    """Whether every string literal of the statement opens and closes on one line, with no
    dollar quoting and no backslash escapes: then a line's quotes tell what is inside one."""
    for line in lines:
        code = _code(line)
        if "$" in code or "\\" in code or code.count("'") % 2:
            return False
    return True


def _code(line: str) -> str:
    """*line* up to its ``--`` comment (the first one outside a string literal)."""
    start = 0
    while (dash := line.find("--", start)) >= 0:
        if line.count("'", 0, dash) % 2 == 0:
            return line[:dash]
        start = dash + 2
    return line


def _compact(line: str) -> str:
    """*line* without its indentation and its ``--`` comment (one outside a string literal):
    a statement over psycopg's 4,096 characters is parsed again on every execution (the
    relay's claim, 4,761 characters with its comments, spent a tenth of its Python there)."""
    return _code(line).strip()


@functools.cache
def queries(package: str) -> Mapping[str, str]:
    """Every query of *package*'s ``queries.sql``, by name, as written (``{schema}`` in it)."""
    source = importlib.resources.files(package).joinpath(QUERY_FILE).read_text("utf-8")
    return parse(source, f"{package}/{QUERY_FILE}")


@functools.cache
def driver_sql(package: str, name: str, schema: str) -> str:
    """Query *name* of *package* for *schema*, as a string for ``exec_driver_sql``."""
    found = queries(package)
    if name not in found:
        raise LookupError(
            f"no query named {name!r} in {package}/{QUERY_FILE} (it has {', '.join(found)})"
        )
    return found[name].replace("{schema}", quote_identifier(schema))


@functools.cache
def sql(package: str, name: str, schema: str) -> TextClause:
    """Query *name* of *package* for *schema*, as a ``TextClause`` for ``execute``."""
    from sqlalchemy import text  # noqa: PLC0415 - the relay's start-up never pays for it

    return text(driver_sql(package, name, schema))

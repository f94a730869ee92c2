"""Every named query (outbox.db.queries) is parsed, analysed and planned by PostgreSQL on a freshly
migrated schema: a query naming a column, table or function the migrations do not create, or
one that does not type-check, fails here by name, not in a relay at run time.

PostgreSQL 15 has no ``EXPLAIN (GENERIC_PLAN)``: each query is PREPAREd (parse and analysis,
parameter types inferred from their use) and then EXPLAINed through EXECUTE with every
parameter NULL under ``plan_cache_mode = force_generic_plan``, so the planner plans it as it
would with its values unknown. Statements PREPARE does not take (SET, GRANT) are run instead,
in the same transaction, which is rolled back.
"""

from __future__ import annotations

import re

import psycopg
import pytest

from outbox.db.queries import queries, quote_identifier, sql
from outbox.db.tables import DIALECT

PACKAGES = ("outbox.db", "relay", "dedup", "console")
SCHEMA = "outboxkit"
# Parameters as the driver sees them: %(name)s, or %(name)b (sent in binary).
_PARAMETER = re.compile(r"%\((\w+)\)[sb]")
# A role for relay_role_grants' {role}, created and dropped with the rolled-back transaction.
PROBE_ROLE = "named_queries_probe"


def named() -> list[tuple[str, str]]:
    return [(package, name) for package in PACKAGES for name in queries(package)]


def positional(package: str, name: str) -> tuple[str, int]:
    """The query's text as psycopg sends it, with $1..$n for its parameters; and n."""
    template = queries(package)[name]
    # A query run as text() is compiled as SQLAlchemy compiles it (":name" becomes
    # "%(name)s" and a literal % is doubled); a driver query is already in that form.
    if _PARAMETER.search(template):
        driver = sql(package, name, SCHEMA).text
    else:
        driver = str(sql(package, name, SCHEMA).compile(dialect=DIALECT))
    numbers: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        return f"${numbers.setdefault(match[1], len(numbers) + 1)}"

    text = _PARAMETER.sub(number, driver).replace("%%", "%").replace("{role}", PROBE_ROLE)
    return text, len(numbers)


def plan(conn: psycopg.Connection[tuple[object, ...]], package: str, name: str) -> None:
    statement, count = positional(package, name)
    if re.match(r"\s*(SET|GRANT)\b", statement):
        conn.execute(statement)
        return
    conn.execute(f"PREPARE probe AS {statement}")
    nulls = f"({', '.join(['NULL'] * count)})" if count else ""
    conn.execute(f"EXPLAIN EXECUTE probe{nulls}").fetchall()
    conn.execute("DEALLOCATE probe")


def test_the_packages_name_their_queries() -> None:
    """The probe below sees every query file (an empty list would prove nothing)."""
    found = named()
    assert ("relay", "claim_messages") in found
    assert ("outbox.db", "emit_many") in found
    assert ("dedup", "insert_marks") in found


def test_every_named_query_plans_on_the_migrated_schema(database_url: str) -> None:
    failures: list[str] = []
    with psycopg.connect(database_url) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(f"CREATE ROLE {PROBE_ROLE}")
        for package, name in named():
            conn.execute("SAVEPOINT probe")
            try:
                plan(conn, package, name)
            except psycopg.Error as exc:
                failures.append(f"{package}/queries.sql {name}: {str(exc).strip()}")
                conn.execute("ROLLBACK TO SAVEPOINT probe")
            else:
                conn.execute("RELEASE SAVEPOINT probe")
        conn.rollback()
    assert not failures, "queries PostgreSQL cannot plan:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    ("package", "name"),
    [("relay", "set_idle"), ("relay", "claim_messages"), ("dedup", "retention_lock")],
)
def test_parameters_become_positional(package: str, name: str) -> None:
    """Both parameter styles reach PREPARE as $n, each name once (what the probe relies on)."""
    statement, count = positional(package, name)
    assert count > 0
    assert f"${count}" in statement
    assert not _PARAMETER.search(statement)
    assert not re.search(r"(?<![:\w]):[a-z_]+\b", statement)


def test_every_keyword_the_server_reserves_is_quoted(database_url: str) -> None:
    """quote_identifier's keywords are PostgreSQL 15's: a newer server that reserves another
    word fails here, not in a relay whose schema has that name."""
    with psycopg.connect(database_url) as conn:
        words = [w for (w,) in conn.execute(
            "SELECT word FROM pg_get_keywords() WHERE catcode <> 'U'")]
        bare = [w for w in words if quote_identifier(w) == w]
        assert len(words) > 100
        assert not bare
        # And a quoted keyword names a schema as any other: one round trip proves it.
        conn.execute(f"CREATE SCHEMA {quote_identifier('user')}")
        assert conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'user'"
                            ).fetchone() == (1,)
        conn.rollback()

"""Apply the numbered SQL files in ``outbox/db/migrations`` to a database, once each, in order.

Each file runs in its own transaction together with its ``schema_versions`` row, under a
transaction-level advisory lock: two migrators started together apply each file once (the
second waits, then finds it applied). Running ``migrate`` again is harmless.

Command line: ``outbox migrate [--database-url URL] [--dry-run]`` (:mod:`outbox.cli.main`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import re
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, TextClause

from outbox.db.hashing import stable_hash64
from outbox.db.queries import quote_identifier, runs_channel, sql
from outbox.db.tables import DIALECT
from outbox.errors import SchemaError
from outbox.settings import OutboxSettings, default_settings

_FILE_NAME = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    """One numbered SQL file; ``{schema}`` in it stands for the configured schema name
    (quoted as every statement quotes it: :func:`outbox.db.queries.quote_identifier`)."""

    version: int
    name: str
    template: str

    def sql(self, schema: str) -> str:
        # Plain replacement, not str.format: SQL is full of braces ('{}'::jsonb).
        # {runs_channel}: the runs' NOTIFY channel as a SQL literal (a trigger wakes workers).
        channel = "'" + runs_channel(schema).replace("'", "''") + "'"
        return (self.template.replace("{schema}", quote_identifier(schema))
                .replace("{runs_channel}", channel))


@functools.cache
def migrations() -> tuple[Migration, ...]:
    """Every migration shipped with this outboxkit, in version order."""
    found = []
    for entry in importlib.resources.files("outbox.db").joinpath("migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match["version"]), match["name"], entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    if [m.version for m in found] != list(range(1, len(found) + 1)):
        raise SchemaError(f"migration files are not numbered 1..n: {[m.version for m in found]}")
    return tuple(found)


def latest_version() -> int:
    """The schema version this outboxkit expects."""
    return migrations()[-1].version


def migrate(bind: Engine | Connection, *, settings: OutboxSettings | None = None) -> list[int]:
    """Apply the pending migrations; return the versions applied (empty if none were pending).

    Given an ``Engine`` or a ``Connection`` outside a transaction, each file commits on its
    own. Given a ``Connection`` already in a transaction (e.g. Alembic's), everything runs in
    that transaction and the caller commits.
    """
    schema = (settings or default_settings()).schema_name
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            return _migrate(conn, schema)
    return _migrate(bind, schema)


def pending_sql(bind: Engine | Connection, *, settings: OutboxSettings | None = None) -> str:
    """The SQL ``migrate`` would run now, as a psql-runnable script (for ``--dry-run``)."""
    schema = (settings or default_settings()).schema_name
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            done = applied_versions(conn, schema)
    else:
        done = applied_versions(bind, schema)
    lock = _literal(_lock(schema))
    parts = [
        f"-- {m.version:04d}_{m.name}\nBEGIN;\n{lock};\n"
        f"{m.sql(schema).strip()}\n{_literal(_record(schema, m))};\nCOMMIT;\n"
        for m in migrations()
        if m.version not in done
    ]
    return "\n".join(parts) if parts else f"-- schema {schema} is up to date\n"


def applied_versions(conn: Connection, schema: str) -> set[int]:
    """Versions recorded in ``schema_versions``; empty when the schema does not exist yet."""
    exists = conn.execute(
        sql("outbox.db", "schema_versions_exists", schema),
        {"name": f"{quote_identifier(schema)}.schema_versions"},
    ).scalar()
    if exists is None:
        return set()
    return set(conn.execute(sql("outbox.db", "applied_versions", schema)).scalars())


def check_schema(conn: Connection, *, settings: OutboxSettings | None = None) -> None:
    """Raise :class:`SchemaError` unless the schema is at exactly this outboxkit's version."""
    schema = (settings or default_settings()).schema_name
    done = applied_versions(conn, schema)
    wanted = latest_version()
    if not done:
        raise SchemaError(
            f"the outboxkit schema {schema!r} does not exist in this database: "
            "run `outbox migrate`"
        )
    if max(done) > wanted:
        raise SchemaError(
            f"the outboxkit schema {schema!r} is at version {max(done)}, newer than this "
            f"outboxkit ({wanted}): upgrade the outboxkit package"
        )
    missing = sorted(set(range(1, wanted + 1)) - done)
    if missing:
        raise SchemaError(
            f"the outboxkit schema {schema!r} lacks migrations {missing}: "
            "run `outbox migrate`"
        )


def _migrate(conn: Connection, schema: str) -> list[int]:
    applied = []
    for migration in migrations():
        with _transaction(conn):
            conn.execute(_lock(schema))
            if migration.version in applied_versions(conn, schema):
                continue
            # The driver's own cursor: a file holds many statements and must not be parsed
            # for bind parameters.
            conn.connection.dbapi_connection.cursor().execute(migration.sql(schema))  # type: ignore[union-attr]
            conn.execute(_record(schema, migration))
        applied.append(migration.version)
    return applied


@contextlib.contextmanager
def _transaction(conn: Connection) -> Iterator[None]:
    if conn.in_transaction():
        yield  # the caller's transaction: they commit
        return
    with conn.begin():
        yield


def _lock(schema: str) -> TextClause:
    """The migrators' lock, held until the migration's transaction ends."""
    key = stable_hash64(b"outboxkit.migrate", schema.encode())
    return sql("outbox.db", "migration_lock", schema).bindparams(key=key)


def _record(schema: str, migration: Migration) -> TextClause:
    return sql("outbox.db", "record_migration", schema).bindparams(
        version=migration.version, name=migration.name
    )


def _literal(statement: TextClause) -> str:
    """*statement* with its values written in, for the ``--dry-run`` script psql runs."""
    return str(statement.compile(dialect=DIALECT, compile_kwargs={"literal_binds": True})).strip()

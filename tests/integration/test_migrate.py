"""The SQL migrations: they build exactly the Core metadata, apply once, and are checkable."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import check_schema, latest_version, migrate, pending_sql
from outbox.db.schema import translate
from outbox.db.tables import metadata
from outbox.errors import SchemaError
from outbox.settings import OutboxSettings


@pytest.fixture
def empty_database(postgres_dsn: str) -> Iterator[str]:
    """A database with nothing in it (not cloned from the migrated template)."""
    name = f"empty_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield with_database(postgres_dsn, name)
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_engine(empty_database: str) -> Iterator[Engine]:
    engine = create_engine(sqlalchemy_url(empty_database))
    try:
        yield engine
    finally:
        engine.dispose()


_CATALOG = {
    "columns": """
        -- position among the live columns: a dropped column keeps its attnum
        SELECT c.relname, rank() OVER (PARTITION BY c.oid ORDER BY a.attnum), a.attname,
               format_type(a.atttypid, a.atttypmod),
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid)
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = %(schema)s AND c.relkind = 'r' AND a.attnum > 0
          AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid)
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        -- Constraint triggers (0013's wake of a parent run) are behaviour, not table shape:
        -- Core does not describe them; tests/integration/test_child_runs.py proves that one.
        WHERE n.nspname = %(schema)s AND k.contype <> 't'
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = %(schema)s ORDER BY 1, 2""",
    "storage": """
        SELECT c.relname, c.relkind, c.reloptions
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = %(schema)s AND c.relkind <> 'v' ORDER BY 1""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, increment_by, cycle
        FROM pg_sequences WHERE schemaname = %(schema)s ORDER BY 1""",
}


def describe(url: str, schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Everything PostgreSQL knows about *schema*'s tables, with the schema name neutralised."""

    def neutral(value: Any) -> Any:
        if isinstance(value, str):
            return value.replace(f"{schema}.", "<schema>.")
        if isinstance(value, list):
            return sorted(neutral(v) for v in value)
        return value

    with psycopg.connect(url) as conn:
        return {
            part: [
                tuple(neutral(v) for v in row) for row in conn.execute(query, {"schema": schema})
            ]
            for part, query in _CATALOG.items()
        }


class TestMigrationsMatchMetadata:
    @pytest.mark.parametrize("schema", ["outboxkit", "agents_custom"])
    def test_sql_migrations_build_exactly_what_the_core_metadata_describes(
        self, postgres_dsn: str, empty_database: str, empty_engine: Engine, schema: str
    ) -> None:
        """Tables, columns, types, nullability, defaults, keys, checks, partial indexes and
        storage options agree between migrations/*.sql and outbox/db/tables.py."""
        settings = OutboxSettings(schema_name=schema)
        migrate(empty_engine, settings=settings)

        name = f"meta_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        meta_url = with_database(postgres_dsn, name)
        meta_engine = create_engine(sqlalchemy_url(meta_url))
        try:
            with meta_engine.begin() as conn:
                conn.execute(text(f"CREATE SCHEMA {schema}"))
                metadata.create_all(
                    conn.execution_options(schema_translate_map=translate(settings))
                )
            from_sql, from_meta = describe(empty_database, schema), describe(meta_url, schema)
        finally:
            meta_engine.dispose()
            with psycopg.connect(postgres_dsn, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        assert from_sql["columns"], "the migrations created no tables"
        assert {row[0] for row in from_sql["columns"]} == set(
            metadata.tables[t].name for t in metadata.tables
        )
        for part in _CATALOG:
            assert from_sql[part] == from_meta[part], part


class TestApplying:
    def test_migrating_twice_applies_nothing_the_second_time(self, empty_engine: Engine) -> None:
        assert migrate(empty_engine) == list(range(1, latest_version() + 1))
        assert migrate(empty_engine) == []
        with empty_engine.connect() as conn:
            rows = conn.execute(text("SELECT version FROM outboxkit.schema_versions")).all()
        assert [r[0] for r in rows] == list(range(1, latest_version() + 1))

    def test_two_concurrent_migrators_apply_each_file_exactly_once(
        self, empty_engine: Engine
    ) -> None:
        results: list[list[int]] = []
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)

        def run() -> None:
            barrier.wait()
            try:
                results.append(migrate(empty_engine))
            except BaseException as exc:  # the test fails on any migrator's error
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        # Each file is applied by exactly one migrator (which one may differ per file).
        applied = sorted(v for versions in results for v in versions)
        assert applied == list(range(1, latest_version() + 1))

    def test_migrate_in_the_callers_transaction_rolls_back_with_it(
        self, empty_engine: Engine
    ) -> None:
        """Alembic style: the caller's transaction holds the migration until it commits."""
        with empty_engine.connect() as conn:
            conn.begin()
            assert migrate(conn) == list(range(1, latest_version() + 1))
            conn.rollback()
        with empty_engine.connect() as conn, pytest.raises(SchemaError, match="does not exist"):
            check_schema(conn)

    def test_pending_sql_creates_the_same_schema_as_migrate(
        self, empty_database: str, empty_engine: Engine, database_url: str
    ) -> None:
        script = pending_sql(empty_engine)
        assert "CREATE TABLE outboxkit.outbox_messages" in script
        with psycopg.connect(empty_database, autocommit=True) as conn:
            conn.execute(script)
        assert describe(empty_database, "outboxkit") == describe(database_url, "outboxkit")
        assert pending_sql(empty_engine).startswith("-- schema outboxkit is up to date")
        assert migrate(empty_engine) == []


class TestCheckSchema:
    def test_missing_schema_says_to_run_outbox_migrate(self, empty_engine: Engine) -> None:
        with empty_engine.connect() as conn, pytest.raises(SchemaError, match="outbox migrate"):
            check_schema(conn)

    def test_migrated_schema_passes(self, engine: Engine) -> None:
        with engine.connect() as conn:
            check_schema(conn)

    def test_schema_behind_says_to_run_outbox_migrate(self, engine: Engine) -> None:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM outboxkit.schema_versions"))
            conn.execute(text("INSERT INTO outboxkit.schema_versions VALUES (0, 'older', now())"))
        with engine.connect() as conn, pytest.raises(SchemaError, match="outbox migrate"):
            check_schema(conn)

    def test_schema_ahead_says_to_upgrade_outboxkit(self, engine: Engine) -> None:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO outboxkit.schema_versions VALUES (:v, 'future', now())"),
                {"v": latest_version() + 1},
            )
        with engine.connect() as conn, pytest.raises(SchemaError, match="upgrade"):
            check_schema(conn)

"""relay/timeline.py: each connection knows its server's timeline, also for a role that may
do nothing else (the relay's least-privileged role), and a server in recovery has none."""

from __future__ import annotations

import uuid

import psycopg
from sqlalchemy import create_engine

from outbox.dsn import sqlalchemy_url
from relay import timeline


def test_a_connection_knows_its_timeline_whatever_its_role(database_url: str) -> None:
    role = f"tl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        (expected,) = admin.execute(
            "SELECT substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)").fetchone() or ("",)
    try:
        _user, rest = database_url.split("://", 1)[1].split("@", 1)
        engine = create_engine(sqlalchemy_url(f"postgresql://{role}@{rest}"))
        timeline.watch(engine)
        try:
            with engine.connect() as conn:
                assert timeline.of(conn) == int(str(expected), 16) >= 1
                # The probe left no transaction open: autocommit can still be switched on.
                auto = conn.execution_options(isolation_level="AUTOCOMMIT")
                assert auto.exec_driver_sql("SELECT 1").scalar_one() == 1
        finally:
            engine.dispose()
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(f"DROP ROLE {role}")


def test_an_unwatched_connection_has_no_timeline(database_url: str) -> None:
    engine = create_engine(sqlalchemy_url(database_url))
    try:
        with engine.connect() as conn:
            assert timeline.of(conn) is None
    finally:
        engine.dispose()

"""The real PostgreSQL behind the fixtures, and the per-test isolation they promise."""

from __future__ import annotations

import psycopg


def _write_row(database_url: str) -> list[tuple[int, str]]:
    with psycopg.connect(database_url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS isolation_probe (id int PRIMARY KEY, v text)")
        # The same primary key in every test: it only works if each test has its own database.
        conn.execute("INSERT INTO isolation_probe VALUES (1, current_database())")
        conn.commit()
        return conn.execute("SELECT id, v FROM isolation_probe").fetchall()


def test_round_trip_through_real_postgres(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
        conn.execute("CREATE TABLE roundtrip (id uuid PRIMARY KEY, body jsonb)")
        conn.execute("INSERT INTO roundtrip VALUES (gen_random_uuid(), %s)", ['{"a": [1, 2]}'])
        conn.commit()
        assert conn.execute("SELECT body->'a'->>1 FROM roundtrip").fetchone() == ("2",)
    assert version is not None
    assert int(version[0]) >= 140000


def test_first_test_writes_row_id_1(database_url: str) -> None:
    rows = _write_row(database_url)
    assert len(rows) == 1


def test_second_test_writes_the_same_row_id_without_conflict(database_url: str) -> None:
    rows = _write_row(database_url)
    assert rows == [(1, database_url.rsplit("/", 1)[1])]

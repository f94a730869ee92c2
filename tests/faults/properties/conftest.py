"""Fixtures of the property suites: one database per module, shared by its examples.

A property test runs hundreds of examples; cloning a database per test (the plugin's
``database_url``) for each parametrized kind would cost more than the examples themselves.
The examples keep each other out with savepoints or their own rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, create_engine

from outbox.db.dsn import sqlalchemy_url, with_database


def _admin(dsn: str, statement: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement)  # type: ignore[arg-type]  # names we made from uuids


@pytest.fixture(scope="module")
def module_database_url(postgres_dsn: str, outboxkit_template: str) -> Iterator[str]:
    """A migrated database for this test module (cloned from the plugin's template)."""
    name = f"t_properties_{uuid.uuid4().hex[:10]}"
    _admin(postgres_dsn, f'CREATE DATABASE "{name}" TEMPLATE "{outboxkit_template}"')
    try:
        yield with_database(postgres_dsn, name)
    finally:
        _admin(postgres_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def module_engine(module_database_url: str) -> Iterator[Engine]:
    engine = create_engine(sqlalchemy_url(module_database_url), pool_size=5)
    try:
        yield engine
    finally:
        engine.dispose()

"""Turning libpq URLs into what SQLAlchemy and other databases need."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def sqlalchemy_url(dsn: str) -> str:
    """``postgresql://…`` → ``postgresql+psycopg://…`` (psycopg 3), leaving others alone."""
    for prefix in ("postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix) :]
    return dsn


def with_database(dsn: str, database: str) -> str:
    """The same server URL, pointing at another database."""
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))

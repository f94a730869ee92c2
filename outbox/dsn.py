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


def redact(url: str) -> str:
    """The URL with its password replaced by ``***``, safe for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://…`` → ``postgresql://…`` for psycopg.connect()."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.startswith("postgresql+"):
        return "postgresql://" + rest
    return url

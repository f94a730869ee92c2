"""The SQLAlchemy engines every outboxkit process makes on a libpq URL (outbox.db.dsn)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy
from sqlalchemy import event, exc

if TYPE_CHECKING:  # SQLAlchemy's asyncio layer pulls in its ORM: daemons do without
    from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import answers
from outbox.db.dsn import connect_args, libpq_url, sqlalchemy_url


def engine_for(
    url: str, *, connect: Mapping[str, Any] | None = None,
    answer_timeout_s: float | None = None, ping_after_idle_s: float | None = None,
    **options: Any
) -> sqlalchemy.Engine:
    """The engine every outboxkit process makes on *url* (a libpq URL, several hosts
    included): :func:`sqlalchemy_url`, :func:`connect_args` with *connect* on top, and
    *options* for :func:`sqlalchemy.create_engine`. A daemon's engine gives
    *answer_timeout_s*: no round trip waits longer for PostgreSQL (:mod:`outbox.db.answers`);
    and *ping_after_idle_s*: a pooled connection is tested before use only when it was idle
    that long (``pool_pre_ping`` tests it every time, a round trip per checkout)."""
    args = connect_args(url, **(connect or {}))
    if answer_timeout_s:
        options["creator"] = answers.connector(libpq_url(url), answer_timeout_s, **args)
        args = {}
    engine = sqlalchemy.create_engine(sqlalchemy_url(url), connect_args=args, **options)
    if ping_after_idle_s is not None:
        _ping_after_idle(engine, ping_after_idle_s)
    return engine


def _ping_after_idle(engine: sqlalchemy.Engine, seconds: float) -> None:
    """Test a pooled connection on checkout when it sat idle *seconds* or more: one that
    died meanwhile (a server restart, a failover, a proxy's idle timeout) is replaced before
    the caller uses it, as ``pool_pre_ping`` would; a busy daemon's connections, used again
    within milliseconds, are not pinged at all."""

    @event.listens_for(engine, "checkin")
    def _returned(dbapi_connection: Any, record: Any) -> None:
        record.info["outboxkit_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _taken(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.get("outboxkit_idle_since")
        if since is not None and time.monotonic() - since >= seconds:
            ping(dbapi_connection)  # if gone, the pool checks out another (a new one)


def ping(dbapi_connection: Any) -> None:
    """One round trip on a psycopg connection that may have died while idle; raises
    :class:`sqlalchemy.exc.DisconnectionError` when it did."""
    autocommit = dbapi_connection.autocommit
    try:
        dbapi_connection.autocommit = True  # no transaction left open by the ping
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        dbapi_connection.autocommit = autocommit
    except Exception as error:
        raise exc.DisconnectionError(f"a pooled connection is gone: {error}") from error


def async_engine_for(url: str, *, answer_timeout_s: float | None = None,
                     **options: Any) -> AsyncEngine:
    """:func:`engine_for` for asyncio."""
    from sqlalchemy.ext.asyncio import create_async_engine  # noqa: PLC0415 - start-up time

    args = connect_args(url)
    if answer_timeout_s:
        options["async_creator"] = answers.async_connector(libpq_url(url), answer_timeout_s,
                                                           **args)
        args = {}
    return create_async_engine(sqlalchemy_url(url), connect_args=args, **options)

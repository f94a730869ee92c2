"""Turning libpq URLs into what SQLAlchemy and other databases need."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import sqlalchemy
from sqlalchemy import event, exc

if TYPE_CHECKING:  # SQLAlchemy's asyncio layer pulls in its ORM: daemons do without
    from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import answers

# libpq waits for a server's first answer as long as TCP does (minutes for a host that
# vanished without a reset, forever for one that hangs), and with several hosts it tries the
# next one only after that: a dead or hung primary would keep every new connection from
# reaching the promoted standby. Keepalives find a pooled idle connection to a dead host.
CONNECT_DEFAULTS: dict[str, int] = {
    "connect_timeout": 5,  # seconds per host; libpq's minimum is 2
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}
_ENVIRONMENT = {"connect_timeout": "PGCONNECT_TIMEOUT"}


def sqlalchemy_url(dsn: str) -> str:
    """``postgresql://…`` → ``postgresql+psycopg://…`` (psycopg 3), leaving others alone.

    A libpq URL with several hosts (``postgresql://u@h1:5432,h2:5432/db?
    target_session_attrs=read-write``, what users write for a primary and its standby) is one
    SQLAlchemy cannot parse (it reads ``5432,h2:5432`` as the port), so its hosts and ports
    move into the query as ``host=h1,h2&port=5432,5432``: SQLAlchemy hands those to psycopg,
    and libpq tries the hosts in order, as it would have from the original URL.
    """
    for prefix in ("postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return _hosts_to_query("postgresql+psycopg://" + dsn[len(prefix) :])
    return dsn


def _hosts_to_query(url: str) -> str:
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if "," not in hostlist:
        return url
    hosts, ports = zip(*(_host_and_port(item) for item in hostlist.split(",")), strict=True)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(key in ("host", "port") for key, _ in query):
        raise ValueError(
            "a database URL gives its hosts both before the path and as host=/port= "
            "parameters; keep one of the two"
        )
    multihost = [("host", ",".join(hosts))]
    if any(ports):
        multihost.append(("port", ",".join(ports)))
    # Built by hand: urlunsplit() drops the "//" of an empty netloc (no user), and SQLAlchemy
    # needs it.
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return (
        f"{parts.scheme}://{userinfo}{at}{parts.path}"
        f"?{urlencode(multihost + query, safe=',:/%')}{fragment}"
    )


def _host_and_port(item: str) -> tuple[str, str]:
    """``h:5432`` → (h, 5432); ``[::1]:5432`` → (::1, 5432); no port → (h, "") (the default)."""
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        return host, rest.removeprefix(":")
    host, _, port = item.partition(":")
    return host, port


def connect_args(url: str, **extra: Any) -> dict[str, Any]:
    """What outboxkit's own engines pass as ``connect_args``: :data:`CONNECT_DEFAULTS` for
    each setting that neither *url* (``?connect_timeout=…``) nor its libpq environment
    variable sets, and *extra*."""
    given = {key for key, _ in parse_qsl(urlsplit(url).query)}
    found = {
        key: value
        for key, value in CONNECT_DEFAULTS.items()
        if key not in given and not os.environ.get(_ENVIRONMENT.get(key, ""))
    }
    return found | extra


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


def with_database(dsn: str, database: str) -> str:
    """The same server URL, pointing at another database."""
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


def redact(url: str) -> str:
    """The URL with its password replaced by ``***``, safe for logs and error messages."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    netloc = f"{user}:***@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def libpq_url(url: str) -> str:
    """``postgresql+psycopg://…`` → ``postgresql://…`` for psycopg.connect().

    libpq reads the ``host=h1,h2&port=p1,p2`` form that sqlalchemy_url() makes of several
    hosts as well, so nothing else needs to change.
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme.startswith("postgresql+"):
        return "postgresql://" + rest
    return url

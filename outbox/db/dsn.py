"""Turning libpq URLs into what SQLAlchemy, psycopg and other clients need.

No SQLAlchemy here: the relay, which runs without it (outbox.db.pool), reads its URL with
these too. The engines every outboxkit process makes are in outbox.db.engines.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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

"""Several hosts in a libpq URL (a primary and its standby): what SQLAlchemy gets from them."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine

from outbox.db import dsn
from outbox.db.dsn import CONNECT_DEFAULTS, libpq_url, redact, sqlalchemy_url, with_database

FAILOVER = (
    "postgresql://app:s3cret@10.0.0.1:5432,10.0.0.2:5433/shop?target_session_attrs=read-write"
)


def connect_args(url: str) -> dict[str, object]:
    engine = create_engine(sqlalchemy_url(url))
    try:
        args = engine.dialect.create_connect_args(engine.url)[1]
    finally:
        engine.dispose()
    args.pop("context", None)
    return dict(args)


def test_hosts_and_ports_reach_psycopg_in_order_with_target_session_attrs() -> None:
    assert sqlalchemy_url(FAILOVER) == (
        "postgresql+psycopg://app:s3cret@/shop"
        "?host=10.0.0.1,10.0.0.2&port=5432,5433&target_session_attrs=read-write"
    )
    assert connect_args(FAILOVER) == {
        "host": "10.0.0.1,10.0.0.2",
        "port": "5432,5433",
        "user": "app",
        "password": "s3cret",
        "dbname": "shop",
        "target_session_attrs": "read-write",
    }


def test_without_user_without_ports_and_ipv6() -> None:
    assert connect_args("postgres://h1,h2/db")["host"] == "h1,h2"
    assert connect_args("postgresql://[::1]:5001,[::1]:5002/db") == {
        "host": "::1,::1",
        "port": "5001,5002",
        "dbname": "db",
    }
    # A port on some hosts only: the others keep libpq's default (an empty entry).
    assert connect_args("postgresql://u@a,b:6000/db")["port"] == ",6000"


def test_one_host_urls_are_unchanged() -> None:
    one = "postgresql://u:p@h:5432/db?sslmode=require"
    assert sqlalchemy_url(one) == "postgresql+psycopg://u:p@h:5432/db?sslmode=require"
    assert sqlalchemy_url("sqlite:///x.db") == "sqlite:///x.db"
    assert redact(one) == "postgresql://u:***@h:5432/db?sslmode=require"
    assert redact("not a url: disk full") == "not a url: disk full"


def test_hosts_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="both before the path and as host="):
        sqlalchemy_url("postgresql://a:1,b:2/db?host=c")


def test_redact_with_database_and_libpq_url_handle_several_hosts() -> None:
    assert redact(FAILOVER) == (
        "postgresql://app:***@10.0.0.1:5432,10.0.0.2:5433/shop?target_session_attrs=read-write"
    )
    assert "s3cret" not in redact(sqlalchemy_url(FAILOVER))
    assert redact("postgresql://app@a:1,b:2/db") == "postgresql://app@a:1,b:2/db"
    assert with_database(FAILOVER, "other").startswith(
        "postgresql://app:s3cret@10.0.0.1:5432,10.0.0.2:5433/other?"
    )
    # psycopg.connect() (the relay's LISTEN connection) reads the translated form too.
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    info = conninfo_to_dict(libpq_url(sqlalchemy_url(FAILOVER)))
    assert info["host"] == "10.0.0.1,10.0.0.2"
    assert info["port"] == "5432,5433"
    assert info["target_session_attrs"] == "read-write"


def test_the_url_and_the_environment_choose_over_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # outboxkit's engines: libpq's defaults wait on a hung host for as long as TCP does.
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    plain = "postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write"
    assert dsn.connect_args(plain) == CONNECT_DEFAULTS
    given = dsn.connect_args(plain + "&connect_timeout=20&keepalives=0")
    assert "connect_timeout" not in given
    assert "keepalives" not in given
    assert given["keepalives_idle"] == CONNECT_DEFAULTS["keepalives_idle"]
    assert dsn.connect_args(plain, options="-c x=1")["options"] == "-c x=1"
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "12")
    assert "connect_timeout" not in dsn.connect_args(plain)

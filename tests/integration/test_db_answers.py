"""A daemon's connection gives up on a PostgreSQL that stops answering (outbox.db.answers),
shown through a real Toxiproxy that keeps the connection but forwards nothing (a hung
pooler or middlebox: TCP keepalives and tcp_user_timeout cannot see it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy import text

from outbox.db.dsn import libpq_url
from outbox.db.engines import async_engine_for, engine_for
from outbox.testing.toxiproxy import Client, Server

BOUND_S = 1.5


@pytest.fixture
def toxi(toxiproxy_server: Server) -> Client:
    return toxiproxy_server.client


@pytest.fixture
def proxied(toxi: Client, database_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """*database_url* through a proxy named after the test."""
    name = request.node.name[:40]
    try:
        yield toxi.front(name, libpq_url(database_url))
    finally:
        toxi.delete(name)


def _hang(toxi: Client, request: pytest.FixtureRequest) -> str:
    """The test's proxy stops forwarding both ways without closing anything; its name."""
    name = request.node.name[:40]
    toxi.timeout(name, 0, stream="downstream")
    toxi.timeout(name, 0, stream="upstream")
    return name


def test_a_statement_without_an_answer_fails_after_the_bound_and_the_pool_recovers(
    toxi: Client, proxied: str, request: pytest.FixtureRequest
) -> None:
    engine = engine_for(proxied, answer_timeout_s=BOUND_S, pool_pre_ping=True)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT 1")).scalar_one() == 1
            name = _hang(toxi, request)
            started = time.monotonic()
            with pytest.raises(sqlalchemy.exc.OperationalError, match="did not answer within"):
                conn.execute(text("SELECT 2"))
            waited = time.monotonic() - started
        assert BOUND_S <= waited < BOUND_S + 2
        for toxic in toxi.toxics(name):  # the path is back
            toxi.remove_toxic(name, str(toxic["name"]))
        assert toxi.proxies()[name].enabled
        with engine.connect() as conn:  # the dead connection was dropped: a new one
            assert conn.execute(text("SELECT 3")).scalar_one() == 3
    finally:
        engine.dispose()


def test_a_commit_without_an_answer_fails_after_the_bound(
    toxi: Client, proxied: str, engine: sqlalchemy.Engine, request: pytest.FixtureRequest
) -> None:
    with engine.begin() as setup:
        setup.execute(text("CREATE TABLE IF NOT EXISTS public.answers_t (n int)"))
    bounded = engine_for(proxied, answer_timeout_s=BOUND_S)
    try:
        conn = bounded.connect()
        conn.execute(text("INSERT INTO public.answers_t VALUES (1)"))
        _hang(toxi, request)
        with pytest.raises(sqlalchemy.exc.OperationalError, match="did not answer within"):
            conn.commit()
        conn.invalidate()
        conn.close()
    finally:
        bounded.dispose()
    # The server never got the COMMIT (nothing was forwarded): the row is not there. Which of
    # the two happened is what the caller cannot know, and why the message says so.
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM public.answers_t")).scalar_one() == 0


def test_without_a_bound_a_slow_answer_is_awaited_and_with_one_it_is_not(
    proxied: str,
) -> None:
    # The bound is on any wait, a slow statement's too: it must exceed the longest one.
    plain = engine_for(proxied)
    bounded = engine_for(proxied, answer_timeout_s=0.5)
    try:
        with plain.connect() as conn:
            assert conn.execute(text("SELECT pg_sleep(1), 1")).one()[1] == 1
        with bounded.connect() as conn, pytest.raises(sqlalchemy.exc.OperationalError):
            conn.execute(text("SELECT pg_sleep(1)"))
    finally:
        plain.dispose()
        bounded.dispose()


def test_the_async_engine_is_bounded_too(toxi: Client, proxied: str,
                                         request: pytest.FixtureRequest) -> None:
    async def run() -> float:
        engine = async_engine_for(proxied, answer_timeout_s=BOUND_S)
        try:
            async with engine.connect() as conn:
                assert (await conn.execute(text("SELECT 1"))).scalar_one() == 1
                _hang(toxi, request)
                started = time.monotonic()
                with pytest.raises(sqlalchemy.exc.OperationalError,
                                   match="did not answer within"):
                    await conn.execute(text("SELECT 2"))
                return time.monotonic() - started
        finally:
            await engine.dispose()

    waited = asyncio.run(run())
    assert BOUND_S <= waited < BOUND_S + 2


def test_a_wait_with_its_own_timeout_keeps_it(proxied: str, tmp_path: Path) -> None:
    # LISTEN's notifies(timeout=...) is not cut short by the bound, nor stretched by it.
    engine = engine_for(proxied, answer_timeout_s=0.3)
    try:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            assert raw is not None
            raw.autocommit = True
            raw.execute("LISTEN answers_test")
            started = time.monotonic()
            assert list(raw.notifies(timeout=1.0)) == []
            assert time.monotonic() - started >= 0.9
            conn.invalidate()
    finally:
        engine.dispose()

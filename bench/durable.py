"""Durable PostgreSQL settings for a benchmark run, shared by the bench scripts.

Test clusters run with fsync=off; figures about commits mean nothing there. ``make_durable``
turns fsync, synchronous_commit and full_page_writes on with ALTER SYSTEM, checks them with
SHOW in a fresh session, and returns a function that restores what was there. It refuses
(SystemExit) when the server cannot be made durable, e.g. fsync=off on its command line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

DURABLE = ("fsync", "synchronous_commit", "full_page_writes")


def _settings(dsn: str) -> dict[str, tuple[str, str, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, setting, source, coalesce(sourcefile, '') FROM pg_settings "
            "WHERE name = ANY(%s)",
            [list(DURABLE)],
        ).fetchall()
    return {name: (setting, source, sourcefile) for name, setting, source, sourcefile in rows}


def show(dsn: str) -> dict[str, str]:
    shown = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in DURABLE:
            row = conn.execute(f"SHOW {name}").fetchone()
            shown[name] = str(row[0]) if row else "?"
    return shown


def _reload_and_wait(dsn: str, want: Callable[[dict[str, str]], bool]) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + 5
    while True:
        now = show(dsn)  # a fresh session sees the reloaded values
        if want(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def make_durable(dsn: str) -> tuple[str, Callable[[], None]]:
    """Turn durability on; return what SHOW says now and the function that restores it."""
    before = _settings(dsn)
    if all(before[name][0] == "on" for name in DURABLE):
        return "already on (fsync, synchronous_commit, full_page_writes = on)", lambda: None

    def restore() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name, (setting, _source, sourcefile) in before.items():
                if sourcefile.endswith("postgresql.auto.conf"):
                    conn.execute(f"ALTER SYSTEM SET {name} = '{setting}'")
                else:
                    conn.execute(f"ALTER SYSTEM RESET {name}")
        _reload_and_wait(dsn, lambda now: all(now[n] == before[n][0] for n in DURABLE))

    was = ", ".join(f"{n}={v[0]} [{v[1]}]" for n, v in sorted(before.items()))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for name in DURABLE:
                conn.execute(f"ALTER SYSTEM SET {name} = on")
    except psycopg.Error as exc:
        raise SystemExit(
            f"REFUSED: durability is off ({was}) and cannot be turned on: {exc}"
        ) from exc
    now = _reload_and_wait(dsn, lambda now: all(now[n] == "on" for n in DURABLE))
    if not all(now[name] == "on" for name in DURABLE):
        restore()
        raise SystemExit(
            f"REFUSED: the server is not durable and ALTER SYSTEM did not change that (was "
            f"{was}; SHOW now says {now}; a setting given on the server's command line wins "
            "over ALTER SYSTEM). Start it without -c fsync=off, or give another server."
        )
    shown = ", ".join(f"{n}={v}" for n, v in now.items())
    return f"turned on by ALTER SYSTEM + reload (SHOW: {shown}; was: {was})", restore

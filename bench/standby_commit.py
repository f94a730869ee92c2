"""What a synchronous standby costs a commit: one emit transaction's latency with the
primary's flush only (``synchronous_commit = local``) against waiting for the standby's
flush too (``on``), on a primary and a synchronous streaming standby of its own (both with
fsync on), blocks of the two alternated, medians of the block medians.

    python bench/standby_commit.py [--blocks 4] [--per-block 300]

Loopback here: production adds the network round trip to the standby to every commit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import psycopg
from sqlalchemy import Engine, create_engine

from outbox.db.dsn import sqlalchemy_url
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from tests.e2e.pg_failover_support import migrate, pg_pair


def block(engine: Engine, mode: str, n: int) -> float:
    """The median milliseconds of *n* one-message transactions committed with *mode*."""
    took = []
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SET synchronous_commit = {mode}")
        conn.commit()
        for i in range(n):
            started = time.perf_counter()
            with conn.begin():
                emit(conn, Envelope(topic="t", type="step", key=str(i), payload={"i": i}))
            took.append(time.perf_counter() - started)
    return statistics.median(took) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--per-block", type=int, default=300)
    args = parser.parse_args()
    with pg_pair(synchronous=True) as pair:
        for node in (pair.primary, pair.standby):
            with psycopg.connect(node.dsn, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET fsync = on")
                conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)  # the reload reaches the servers' processes asynchronously
        for node in (pair.primary, pair.standby):
            with psycopg.connect(node.dsn, autocommit=True) as conn:
                assert conn.execute("SHOW fsync").fetchone() == ("on",), "fsync stayed off"
        migrate(pair.url)
        engine = create_engine(sqlalchemy_url(pair.url))
        found: dict[str, list[float]] = {"local": [], "on": []}
        try:
            for _ in range(args.blocks):
                for mode, medians in found.items():
                    medians.append(block(engine, mode, args.per_block))
        finally:
            engine.dispose()
    local, on = (statistics.median(found[m]) for m in ("local", "on"))
    for mode, medians in found.items():
        print(f"synchronous_commit={mode:5}  ms per commit, block medians "
              f"{[round(m, 2) for m in medians]}")
    print(f"primary only {local:.2f} ms, with the synchronous standby {on:.2f} ms: "
          f"+{on - local:.2f} ms, {on / local:.2f}x")


if __name__ == "__main__":
    main()

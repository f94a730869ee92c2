"""What numbering a run's events costs its writers (migration 0019): ``run_events.*_us``.

The schema is migrated twice into a throwaway database, once with the event triggers and
once with them disabled (``ALTER TABLE ... DISABLE TRIGGER``), and one run is claimed in
each. Then, each in a transaction of its own (events are numbered at COMMIT, so the commit
is timed too): a checkpoint save with no log entry (no event: the control), with one entry
(a durable agent's step; the named query ``save_checkpoint`` straight to psycopg) and with
four, an emit of the run's message under its lease, and an emit of a message without a run
(the WHEN clause: no event). The two schemas take turns statement by statement on one
connection, so a busy machine slows both alike; a figure is the median, over batches of
*per-batch* statements, of each batch's mean, and the added cost the median of the batches'
differences (with minus without), shown with the middle half of them. Last, the same log
entry without the client (``server_log_entry_added_us``): a procedure inserts and commits it
300 times in each schema, timed by the server's clock.

    python bench/run_events_bench.py --database-url postgresql://postgres@host/postgres \\
        [--batches 40] [--per-batch 50] [--json results.json]

The database given is only used to create (and at the end drop) a throwaway one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import psycopg
from figures import Figure
from figures import print_table as print_figures
from sqlalchemy import Connection, create_engine

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from outbox.runs.leases import Lease
from outbox.runs.lifecycle import claim, start_run
from outbox.runs.runlog import save_statement
from outbox.settings import OutboxSettings

TRIGGERS = {"run_log": ["run_log_event", "run_log_rewritten_event"],
            "outbox_messages": ["outbox_messages_event"]}
SCHEMAS = {True: "events_on", False: "events_off"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--per-batch", type=int, default=50)
    parser.add_argument("--json", help="write the figures here")
    return parser.parse_args(argv)


class Writer:
    """One schema's claimed run, its lease kept current across saves."""

    def __init__(self, conn: Connection, schema: str) -> None:
        self.conn, self.seq = conn, 0
        self.settings = OutboxSettings(schema_name=schema)
        with conn.begin():
            start_run(conn, workflow="wf", workflow_version="1", idempotency_key="bench",
                      settings=self.settings)
        with conn.begin():
            got = claim(conn, worker="bench", lease_seconds=3600, settings=self.settings)
        assert got is not None
        self.lease: Lease = got.lease
        self.cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]

    def save(self, entries: int) -> None:
        log = {self.seq + i: {"op": "model.request", "result": {"parts": ["x" * 200]}}
               for i in range(entries)}
        self.seq += entries
        sql, params = save_statement(self.lease, {"n": self.seq}, None, log, self.settings)
        with self.conn.begin():
            self.cursor.execute(sql, params)
            version = self.cursor.fetchone()[0]
        self.lease = Lease(self.lease.run_id, self.lease.owner, self.lease.token, version,
                           self.lease.expires_at)

    def emit(self, with_run: bool) -> None:
        envelope = Envelope(topic="t", type="t", key="k", payload={"n": 1})
        with self.conn.begin():
            emit(self.conn, envelope, lease=self.lease if with_run else None,
                 settings=self.settings, notify=False)


def cases(writer: Writer) -> dict[str, Callable[[], None]]:
    return {"save_0": lambda: writer.save(0), "save_1": lambda: writer.save(1),
            "save_4": lambda: writer.save(4), "emit_run": lambda: writer.emit(True),
            "emit_no_run": lambda: writer.emit(False)}


def measure(writers: dict[bool, Writer], batches: int, per_batch: int
            ) -> dict[tuple[str, bool], list[float]]:
    """Each batch's mean per statement (µs), by case and whether the triggers were on."""
    work = {on: cases(w) for on, w in writers.items()}
    for on in writers:  # warm: statement caches, the first pages
        for case in work[on].values():
            for _ in range(20):
                case()
    samples: dict[tuple[str, bool], list[float]] = {}
    for batch in range(batches):
        for label in work[True]:
            spent = {True: 0.0, False: 0.0}
            for i in range(per_batch):
                for on in ((True, False) if (batch + i) % 2 else (False, True)):
                    start = time.perf_counter()
                    work[on][label]()
                    spent[on] += time.perf_counter() - start
            for on, total in spent.items():
                samples.setdefault((label, on), []).append(total / per_batch * 1e6)
    return samples


# The same event without the client: a procedure that inserts a log entry and commits, n
# times, timed by the server's clock (its COMMIT fires the deferred trigger).
_PROCEDURE = """CREATE PROCEDURE {schema}.bench_log(run uuid, n int, start int, INOUT us float8)
LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz := clock_timestamp();
BEGIN
    FOR i IN start..start + n - 1 LOOP
        INSERT INTO {schema}.run_log VALUES (run, i, '{{"op": "x", "result": 1}}');
        COMMIT;
    END LOOP;
    us := extract(epoch FROM clock_timestamp() - t0) * 1e6 / n;
END $$"""


def server_side(writers: dict[bool, Writer], rounds: int, n: int = 300
                ) -> dict[bool, list[float]]:
    """µs per committed log entry inside the server, with and without the triggers."""
    times: dict[bool, list[float]] = {True: [], False: []}
    driver = writers[True].conn.connection.driver_connection
    assert driver is not None
    writers[True].conn.commit()
    driver.autocommit = True  # a procedure that commits must not run inside a transaction
    try:
        for writer in writers.values():
            driver.execute(_PROCEDURE.format(schema=writer.settings.schema_name))
        start = 100_000
        for _ in range(rounds):
            for on, writer in writers.items():
                row = driver.execute(
                    f"CALL {writer.settings.schema_name}.bench_log(%s, %s, %s, NULL)",
                    (writer.lease.run_id, n, start)).fetchone()
                assert row is not None
                times[on].append(float(row[0]))
            start += n
    finally:
        driver.autocommit = False
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    name = f"run_events_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.database_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    engine = create_engine(sqlalchemy_url(with_database(args.database_url, name)))
    try:
        for schema in SCHEMAS.values():
            migrate(engine, settings=OutboxSettings(schema_name=schema))
        with engine.connect() as conn:
            with conn.begin():
                for table, triggers in TRIGGERS.items():
                    for trigger in triggers:
                        conn.exec_driver_sql(f"ALTER TABLE {SCHEMAS[False]}.{table} "
                                             f"DISABLE TRIGGER {trigger}")
            writers = {on: Writer(conn, schema) for on, schema in SCHEMAS.items()}
            samples = measure(writers, args.batches, args.per_batch)
            inside = server_side(writers, max(args.batches // 4, 5))
    finally:
        engine.dispose()
        with psycopg.connect(args.database_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    figures: list[Figure] = []
    for label in ("save_0", "save_1", "save_4", "emit_run", "emit_no_run"):
        on, off = samples[label, True], samples[label, False]
        # Paired by batch (the two schemas took turns within it): a burst of load elsewhere
        # slows both sides of one pair, and the median of the differences ignores it.
        added = sorted(a - b for a, b in zip(on, off, strict=True))
        quarter = len(added) // 4
        figures.append(Figure(f"run_events.{label}_us", statistics.median(on), "us",
                              note=f"{statistics.median(off):.0f} us without the triggers"))
        figures.append(Figure(
            f"run_events.{label}_added_us", statistics.median(added), "us",
            note=f"middle half of the batches: {added[quarter]:.0f}..{added[-quarter - 1]:.0f}"))
    on, off = statistics.median(inside[True]), statistics.median(inside[False])
    figures.append(Figure("run_events.server_log_entry_added_us", on - off, "us",
                          note=f"a log entry and its commit inside the server: {on:.0f} us, "
                               f"{off:.0f} us without the triggers"))
    print_figures(figures)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([f.as_json() for f in figures], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

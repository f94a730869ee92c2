"""What a run claim costs with a deep queue: ``outbox.claim_backlog_ratio``.

Two schemas in a throwaway database: one with 10,000 queued runs, one with 1,000,000, each
loaded by one ``INSERT ... SELECT generate_series``. Beside the queued runs each holds what
a real deployment has and a claim must not read: 1% running with live leases, 1% waiting on
far timers, 1% queued with a ``not_before`` in the future; and a few due in every other way
(waiting runs whose timer passed, running runs whose lease expired). Both schemas' key
indexes are read into memory first (see warm). Then rounds of claims,
alternating the two schemas: each claim is ``outbox.runs.lifecycle.claim`` in its own transaction,
committed (a worker taking work); the claim call is timed, the COMMIT is not (it costs the
same at any depth). The figure is the median over rounds of each round's median claim time
with 1,000,000 runs against 10,000; goal <= 1.5. Before migration 0007 it was ~12 ms against
155-195 ms at 200,000 already.

    python bench/run_claim.py --database-url postgresql://postgres@host/postgres \\
        [--quick] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

from figures import Figure, fmt
from figures import print_table as print_figures
from sqlalchemy import Engine, create_engine, text

from outbox.db.dsn import sqlalchemy_url, with_database
from outbox.db.migrate import migrate
from outbox.runs.lifecycle import claim
from outbox.settings import OutboxSettings

GOAL = 1.5

_LOAD = """
INSERT INTO {schema}.agent_runs
    (id, workflow, workflow_version, state, idempotency_key, created_at, not_before,
     lease_owner, lease_expires_at)
SELECT gen_random_uuid(), 'bench', '1',
       CASE WHEN g % 100 = 1 OR g % 50000 = 7 THEN 'running'
            WHEN g % 100 = 2 OR g % 50000 = 8 THEN 'waiting'
            ELSE 'queued' END,
       'run-' || g,
       now() - interval '1 day' + g * interval '10 microseconds',
       CASE WHEN g % 100 IN (2, 3) THEN now() + interval '30 days'
            WHEN g % 50000 = 8 THEN now() - interval '1 minute' END,
       CASE WHEN g % 100 = 1 OR g % 50000 = 7 THEN 'gone' END,
       CASE WHEN g % 100 = 1 THEN now() + interval '1 day'
            WHEN g % 50000 = 7 THEN now() - interval '1 minute' END
FROM generate_series(1, :rows) AS g
"""


def load(engine: Engine, settings: OutboxSettings, rows: int) -> float:
    """Migrate *settings*' schema and fill it; the seconds the load took."""
    migrate(engine, settings=settings)
    started = time.monotonic()
    with engine.begin() as conn:
        conn.execute(text(_LOAD.replace("{schema}", settings.schema_name)), {"rows": rows})
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            text(f"VACUUM ANALYZE {settings.schema_name}.agent_runs"))
    return time.monotonic() - started


def warm(engine: Engine, settings: OutboxSettings) -> None:
    """Read the primary and idempotency keys' indexes into shared buffers.

    A claim's UPDATE writes a new entry into each at a random place (both keys are random), at
    any depth of queue; a running system holds them in memory (74 MB for 1,000,000 runs). Cold,
    right after the load, they cost the deep queue about 0.7 ms a claim of page reads here
    that the 10,000-run schema never pays: a cache effect, not what the claim reads.
    """
    table = f"{settings.schema_name}.agent_runs"
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        conn.execute(text("SET LOCAL enable_sort = off"))
        for key in ("id", "idempotency_key"):
            conn.execute(text(f"SELECT count(*) FROM (SELECT {key} FROM {table} ORDER BY {key}) k"))


def claim_times(engine: Engine, settings: OutboxSettings, claims: int) -> list[float]:
    """Milliseconds of each of *claims* claims, each committed in its own transaction."""
    times = []
    with engine.connect() as conn:
        for _ in range(claims):
            started = time.perf_counter()
            got = claim(conn, worker="bench", lease_seconds=3600, settings=settings)
            times.append((time.perf_counter() - started) * 1000)
            assert got is not None, "the queue ran dry: load more runs"
            conn.commit()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--database-url", default=os.environ.get("OUTBOXKIT_DATABASE_URL"))
    parser.add_argument("--json", help="write the figures as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="a smoke run (50,000 runs)")
    parser.add_argument("--small", type=int, default=10_000, help="queued runs, the baseline")
    parser.add_argument("--backlog", type=int, help="queued runs, deep (default 1,000,000)")
    parser.add_argument("--claims", type=int, default=50, help="claims per size and round")
    parser.add_argument("--rounds", type=int, help="rounds (default 5; 2 with --quick)")
    parser.add_argument("--allow-not-durable", action="store_true",
                        help="accepted for the suite; the COMMIT is not timed here")
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("give --database-url or set OUTBOXKIT_DATABASE_URL")
    backlog = args.backlog or (50_000 if args.quick else 1_000_000)
    rounds = args.rounds or (2 if args.quick else 5)
    sizes = {"small": args.small, "backlog": backlog}

    name = f"outboxkit_claim_{uuid.uuid4().hex[:8]}"
    admin = create_engine(sqlalchemy_url(args.database_url), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = create_engine(sqlalchemy_url(with_database(args.database_url, name)))
    samples: dict[str, list[float]] = {size: [] for size in sizes}
    try:
        settings = {size: OutboxSettings(schema_name=f"claim_{size}") for size in sizes}
        for size, rows in sizes.items():
            seconds = load(engine, settings[size], rows)
            print(f"loaded {rows:,} runs in {seconds:.0f} s", flush=True)
        for size in sizes:
            warm(engine, settings[size])
            claim_times(engine, settings[size], 10)  # warm up: caches, prepared statements
        for round_no in range(rounds):
            # Alternate which size goes first, so drift in the machine's load favours neither.
            order = list(sizes) if round_no % 2 == 0 else list(reversed(sizes))
            for size in order:
                samples[size].append(statistics.median(
                    claim_times(engine, settings[size], args.claims)))
            print(f"round {round_no + 1}/{rounds}: median ms "
                  f"{ {s: round(samples[s][-1], 3) for s in sizes} }", flush=True)
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    ratios = [b / s for b, s in zip(samples["backlog"], samples["small"], strict=True)]
    ratio = statistics.median(ratios)
    small_ms = statistics.median(samples["small"])
    backlog_ms = statistics.median(samples["backlog"])
    figures = [
        Figure("outbox.claim_ms_small", small_ms, "ms",
               note=f"median claim with {args.small:,} queued runs"),
        Figure("outbox.claim_ms_backlog", backlog_ms, "ms",
               note=f"median claim with {backlog:,} queued runs"),
        Figure("outbox.claim_backlog_ratio", ratio, "ratio", None, ratio, f"<= {GOAL}",
               ratio <= GOAL,
               note=f"claim time {backlog:,} / {args.small:,} queued runs ({fmt(backlog_ms)} / "
               f"{fmt(small_ms)} ms), median of per-round ratios "
               f"{[round(r, 2) for r in ratios]}"),
    ]
    print()
    print_figures(figures)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"sizes": sizes, "claims": args.claims, "rounds": rounds,
                       "samples_ms": samples, "figures": [f.as_json() for f in figures]},
                      out, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

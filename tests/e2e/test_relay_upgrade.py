"""Upgrading a database with a backlog from the schema before the outbox log (0004) with
`outbox migrate`: every pending row is published once, in order; published rows are not sent
again and keep their proof; a failed row stays failed, with its error."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text

from outbox.db.dsn import sqlalchemy_url
from outbox.db.migrate import _literal, _record, migrations
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from tests.e2e.conftest import RelayProcesses, read_topic, wait_until
from tests.integration.databases import fresh_database

BEFORE_THE_LOG = 4


@pytest.fixture
def old_database(postgres_dsn: str) -> Iterator[str]:
    """A database at schema version 4, as outboxkit left it before migration 0006."""
    with fresh_database(postgres_dsn) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            for m in migrations()[:BEFORE_THE_LOG]:
                with conn.transaction():
                    conn.execute(m.sql("outboxkit"))  # type: ignore[arg-type]
                    conn.execute(_literal(_record("outboxkit", m)))  # type: ignore[arg-type]
        yield url


def test_a_backlog_from_schema_0004_is_published_once_in_order_after_outbox_migrate(
    old_database: str, kafka_bootstrap: str, tmp_path: object
) -> None:
    topic = f"upgrade-{uuid.uuid4().hex[:8]}"
    engine: Engine = create_engine(sqlalchemy_url(old_database))
    try:
        envelopes = [Envelope(topic=topic, type="t", key=f"k{i % 5}", payload={"i": i})
                     for i in range(60)]
        with engine.begin() as conn:
            for envelope in envelopes:
                emit(conn, envelope)
            # The first ten were published by the old relay, the eleventh refused.
            conn.execute(text(
                "UPDATE outboxkit.outbox_messages SET status = 'published', published_at = now(),"
                " kafka_partition = 0, kafka_offset = id + 1000 WHERE id <= (SELECT min(id) + 9"
                " FROM outboxkit.outbox_messages)"))
            conn.execute(text(
                "UPDATE outboxkit.outbox_messages SET status = 'failed', last_error = 'refused',"
                " failed_at = now()"
                " WHERE id = (SELECT min(id) + 10 FROM outboxkit.outbox_messages)"))
        migrated = subprocess.run(
            [sys.executable, "-m", "outbox.cli.main", "migrate", "--database-url", old_database],
            capture_output=True, text=True, timeout=120, check=False)
        assert migrated.returncode == 0, migrated.stderr
        with engine.connect() as conn:
            assert conn.execute(text(
                "SELECT status, count(*) FROM outboxkit.message_status GROUP BY 1 ORDER BY 1"
            )).all() == [("failed", 1), ("pending", 49), ("published", 10)]
            kept = conn.execute(text(
                "SELECT kafka_offset - id FROM outboxkit.message_status WHERE status = 'published'"
            )).scalars().all()
            assert set(kept) == {1000}  # the old proof, moved to deliveries

        relays = RelayProcesses(old_database, kafka_bootstrap, tmp_path)  # type: ignore[arg-type]
        try:
            relays.start()
            wait_until(lambda: len(read_topic(kafka_bootstrap, topic, timeout_s=5)) >= 49, 60,
                       "the backlog published")
            with engine.connect() as conn:
                wait_until(lambda: conn.execute(text(
                    "SELECT count(*) FROM outboxkit.message_status WHERE status = 'pending'"
                )).scalar_one() == 0, 30, "nothing pending")
        finally:
            relays.stop_all()
        records = read_topic(kafka_bootstrap, topic)
        sent = [envelopes[i] for i in range(11, 60)]
        got = [dict(r.headers)["message-id"].decode() for r in records]
        assert sorted(got) == sorted(str(e.message_id) for e in sent)  # once each
        by_key: dict[bytes, list[int]] = defaultdict(list)
        for r in records:
            by_key[r.key].append(int(r.value.decode().split(":")[1].strip(" }")))
        for key, order in by_key.items():
            assert order == sorted(order), key
        with engine.connect() as conn:
            assert conn.execute(text(
                "SELECT error FROM outboxkit.outbox_failures")).scalars().all() == ["refused"]
    finally:
        engine.dispose()

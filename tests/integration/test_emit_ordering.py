"""Per-key commit order: what the relay can see, it sees in id order for every key.

Ids are drawn at INSERT but become visible at COMMIT, so under concurrency a lower id of
a key can become visible after a higher one, and a relay publishing in id order would put
that key out of order in Kafka. An observer polls the table while writers commit with
random pauses between emit and commit; for each key, the poll in which a row first became
visible must never decrease as ids grow.
"""

from __future__ import annotations

import importlib
import itertools
import random
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope

# Not `from outbox import emit`: the package re-exports the function under that name.
emit_module = importlib.import_module("outbox.messages.emit")

WRITERS = 8
PER_WRITER = 30
KEYS = ["k0", "k1", "k2"]


def _writer(engine: Engine, seed: int, errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    try:
        with engine.connect() as conn:
            for n in range(PER_WRITER):
                key = rng.choice(KEYS)
                emit(conn, Envelope(topic="orders", type="t", key=key, payload={"n": n}))
                time.sleep(rng.uniform(0, 0.004))  # work between emit and commit
                conn.commit()
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def visibility_inversions(engine: Engine, database_url: str) -> int:
    """Run the workload; count adjacent same-key id pairs that became visible out of order."""
    first_seen: dict[int, int] = {}
    keys: dict[int, bytes] = {}
    done = threading.Event()

    def observe(conn: psycopg.Connection[Any], epoch: int) -> None:
        rows = conn.execute("SELECT id, key FROM outboxkit.outbox_messages").fetchall()
        for row_id, key in rows:
            if row_id not in first_seen:
                first_seen[row_id], keys[row_id] = epoch, key

    def observer() -> None:
        with psycopg.connect(database_url, autocommit=True) as conn:
            epoch = 0
            while not done.is_set():
                observe(conn, epoch)
                epoch += 1
            observe(conn, epoch)

    errors: list[BaseException] = []
    watcher = threading.Thread(target=observer)
    watcher.start()
    writers = [
        threading.Thread(target=_writer, args=(engine, seed, errors)) for seed in range(WRITERS)
    ]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    done.set()
    watcher.join()
    assert errors == []
    assert len(first_seen) == WRITERS * PER_WRITER

    by_key: dict[bytes, list[int]] = defaultdict(list)
    for row_id in sorted(first_seen):
        by_key[keys[row_id]].append(first_seen[row_id])
    return sum(1 for epochs in by_key.values() for a, b in itertools.pairwise(epochs) if a > b)


def test_same_key_rows_become_visible_in_id_order(engine: Engine, database_url: str) -> None:
    assert visibility_inversions(engine, database_url) == 0


def test_without_the_key_lock_the_same_workload_reorders_a_key(
    engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above is sensitive: with the advisory lock switched off it fails."""
    monkeypatch.setattr(emit_module, "ordering_lock_key", lambda topic, key: None)
    assert visibility_inversions(engine, database_url) > 0

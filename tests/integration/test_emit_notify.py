"""Wake-up: emit notifies only while a relay is idle and heartbeating, and only on commit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, insert, text

from outbox.emit import emit
from outbox.envelope import Envelope
from outbox.lanes import lane_for
from outbox.settings import OutboxSettings
from outbox.tables import relays

CHANNEL = OutboxSettings().notify_channel


@pytest.fixture
def listener(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")  # a validated identifier
        yield conn


def received(conn: psycopg.Connection[Any], timeout: float = 0.5) -> list[psycopg.Notify]:
    return list(conn.notifies(timeout=timeout, stop_after=1))


def add_relay(engine: Engine, *, idle: bool, heartbeat_age_seconds: float = 0) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(relays).values(
                relay_id="relay-1",
                idle=idle,
                heartbeat_at=text(f"now() - interval '{heartbeat_age_seconds} seconds'"),
            )
        )


def emit_one(engine: Engine, *, commit: bool = True) -> Envelope:
    envelope = Envelope(topic="orders", type="t", key="order-9", payload={})
    with engine.connect() as conn:
        emit(conn, envelope)
        conn.commit() if commit else conn.rollback()
    return envelope


def test_no_relay_means_no_notification(engine: Engine, listener: Any) -> None:
    emit_one(engine)
    assert received(listener) == []


def test_busy_relay_is_not_notified(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=False)
    emit_one(engine)
    assert received(listener) == []


def test_idle_relay_with_a_stale_heartbeat_is_presumed_dead(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=True, heartbeat_age_seconds=OutboxSettings().relay_idle_seconds + 5)
    emit_one(engine)
    assert received(listener) == []


def test_idle_relay_is_notified_with_the_lane_after_commit(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=True)
    with engine.connect() as conn:
        envelope = Envelope(topic="orders", type="t", key="order-9", payload={})
        emit(conn, envelope)
        assert received(listener, timeout=0.3) == [], "notified before commit"
        conn.commit()
    notes = received(listener)
    lane = lane_for(b"order-9", envelope.message_id, OutboxSettings().lanes)
    assert [(n.channel, n.payload) for n in notes] == [(CHANNEL, str(lane))]


def test_idle_relay_is_not_notified_after_rollback(engine: Engine, listener: Any) -> None:
    add_relay(engine, idle=True)
    emit_one(engine, commit=False)
    assert received(listener) == []

"""Writing a message to the outbox inside the caller's transaction: :func:`emit`.

One statement does everything, so emitting costs one round trip:

* **fence** — with a lease, the row is inserted only while the run's ``lease_token`` and
  ``version`` still match (and the run row is share-locked until commit, so a takeover
  waits for this transaction instead of racing it);
* **order** — a transaction-scoped advisory lock on ``(topic, key)`` is taken before the
  row's id is drawn and held until commit, so for one key id order *is* commit order and the
  relay, which publishes in id order, keeps Kafka in commit order. Emitting several keys in
  one transaction in different orders from concurrent transactions can deadlock (PostgreSQL
  then aborts one): emit a transaction's keys in a consistent order, or use
  :func:`emit_many`, which takes the locks in one global order;
* **wake** — ``pg_notify`` fires only while some relay has declared itself idle (and is
  heartbeating): a transaction that NOTIFYs takes a database-wide lock at commit, so a busy
  system, whose relays poll anyway, never pays for it. ``notify=False`` never fires it: for a
  transaction that will be prepared (two-phase commit), which PostgreSQL refuses to PREPARE
  once it has executed NOTIFY. The relay's fallback poll then finds the row: later, not lost.

Emitting the same ``message_id`` twice writes one row: the second emit is a no-op.

:func:`emit_many` keeps every one of these promises for a whole batch in one statement too
(arrays unnested in the server), so its cost per message is a row, not a round trip.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Row
from sqlalchemy.exc import ProgrammingError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from outbox.db.execution import (
    AsyncConn,
    DriverStatement,
    Plan,
    SyncConn,
    driver_row_async,
    missing_schema,
)
from outbox.db.queries import driver_sql
from outbox.errors import InvalidMessage, LeaseLost
from outbox.messages.envelope import Envelope, encode
from outbox.messages.lanes import lane_for, ordering_lock_key
from outbox.runs.leases import Lease
from outbox.runtime import tracing
from outbox.runtime.failpoints import failpoint
from outbox.settings import OutboxSettings, default_settings


def emit(
    conn: SyncConn,
    envelope: Envelope,
    *,
    lease: Lease | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> uuid.UUID:
    """Add *envelope* to the outbox inside the caller's transaction; return its message id.

    Never commits: the relay sees the row only when the caller's transaction commits,
    together with the state change that decided it; a rollback leaves no trace.

    ``notify=False``: never wake an idle relay (no NOTIFY), for a transaction that will be
    prepared (``PREPARE TRANSACTION``, which PostgreSQL refuses after a NOTIFY); the relay's
    fallback poll picks the row up once the transaction commits.

    Raises:
        InvalidMessage: the envelope broke a rule; no statement was sent.
        LeaseLost: *lease* no longer holds the run; nothing was written.
    """
    # The span is current while the envelope is encoded, so its traceparent is this span's:
    # the relay's publish span becomes the child of this emit, in the caller's trace.
    with tracing.start_span(_SPAN) as span:
        sql, params = _prepare(envelope, lease, settings or default_settings(), notify)
        _describe(span, [params])
        connection = conn.connection() if isinstance(conn, Session) else conn
        try:
            row = connection.exec_driver_sql(sql, params).one()
        except ProgrammingError as exc:
            raise _translated(exc, settings) from exc
        return _outcome(row, params, lease)


def emit_plan(envelope: Envelope, *, lease: Lease | None, settings: OutboxSettings | None,
              notify: bool = True) -> Plan[uuid.UUID]:
    """:func:`emit` as a step of a plan (:mod:`outbox.db.execution`), for writes that commit
    with other statements of the same plan (a run's effect and its compensation)."""
    sql, params = _prepare(envelope, lease, settings or default_settings(), notify)
    rows = yield DriverStatement(sql, params)
    if lease is not None and not rows[0]["fenced"]:
        raise LeaseLost(lease.run_id, lease.token)
    message_id: uuid.UUID = params["message_id"]
    return message_id


async def _emit_async(
    conn: AsyncConn,
    envelope: Envelope,
    *,
    lease: Lease | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> uuid.UUID:
    """:func:`emit` on an ``AsyncConnection`` / ``AsyncSession`` (public as
    :func:`outbox.aio.emit`); never commits either."""
    with tracing.start_span(_SPAN) as span:
        sql, params = _prepare(envelope, lease, settings or default_settings(), notify)
        _describe(span, [params])
        connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
        try:
            row = await driver_row_async(connection, sql, params)
        except ProgrammingError as exc:
            raise _translated(exc, settings) from exc
        return _outcome(row, params, lease)


def emit_many(
    conn: SyncConn,
    envelopes: Sequence[Envelope],
    *,
    lease: Lease | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> list[uuid.UUID]:
    """Emit several messages in the caller's transaction, deadlock-free; never commits.

    Every envelope is validated before the statement is sent, so one bad message leaves the
    transaction untouched (its :class:`InvalidMessage` says its ``index``). One statement
    then takes the per-key locks in one global order (by lock key; a stable sort, so messages
    of one key keep the order given), which is what keeps concurrent multi-key transactions
    from deadlocking on each other, and inserts every row. Returns the message ids in the
    order of *envelopes*.

    Each distinct (topic, key) holds a lock in PostgreSQL's shared lock table until commit,
    so a call may carry at most ``settings.emit_many_max_keys`` of them (keyless messages
    take no lock); more is refused before anything is sent. ``notify`` as in :func:`emit`.

    Raises:
        InvalidMessage: an envelope broke a rule (``index`` says which), or the batch has
            more distinct keys than the bound (no ``index``); nothing was sent.
        LeaseLost: *lease* no longer holds the run; nothing was written.
    """
    resolved = settings or default_settings()
    with tracing.start_span(_SPAN) as span:  # one span: every message carries its context
        messages = _prepare_batch(envelopes, lease, resolved)
        _describe(span, messages)
        if not messages:
            return []
        sql, params = _batch(messages, lease, resolved, notify)
        connection = conn.connection() if isinstance(conn, Session) else conn
        try:
            row = connection.exec_driver_sql(sql, params).one()
        except ProgrammingError as exc:
            raise _translated(exc, settings) from exc
        return _batch_outcome(row, messages, lease)


async def _emit_many_async(
    conn: AsyncConn,
    envelopes: Sequence[Envelope],
    *,
    lease: Lease | None = None,
    settings: OutboxSettings | None = None,
    notify: bool = True,
) -> list[uuid.UUID]:
    """:func:`emit_many` on an ``AsyncConnection`` / ``AsyncSession`` (public as
    :func:`outbox.aio.emit_many`); never commits either."""
    resolved = settings or default_settings()
    with tracing.start_span(_SPAN) as span:
        messages = _prepare_batch(envelopes, lease, resolved)
        _describe(span, messages)
        if not messages:
            return []
        sql, params = _batch(messages, lease, resolved, notify)
        connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
        try:
            # Through SQLAlchemy (its statement events see it): its cost per statement is
            # nothing against a batch's rows.
            row = (await connection.exec_driver_sql(sql, params)).one()
        except ProgrammingError as exc:
            raise _translated(exc, settings) from exc
        return _batch_outcome(row, messages, lease)


_SPAN = "outbox.emit"


def _describe(span: Any, messages: list[dict[str, Any]]) -> None:
    """The emit span's attributes (nothing at all when tracing is off)."""
    if span is None:
        return
    topics = {m["topic"] for m in messages}
    runs = {m["run_id"] for m in messages}
    tracing.set_attributes(
        span,
        {
            "messaging.system": "kafka",
            "messaging.destination.name": topics.pop() if len(topics) == 1 else None,
            "messaging.message.id": str(messages[0]["message_id"]) if len(messages) == 1 else None,
            "messaging.batch.message_count": len(messages) if len(messages) != 1 else None,
            "outboxkit.run_id": str(runs.pop()) if len(runs) == 1 and None not in runs else None,
        },
    )


def _lock_order(message: dict[str, Any]) -> int:
    """Sort key taking per-key locks in one global order; keyless messages take none."""
    lock_key: int | None = message["lock_key"]
    return lock_key if lock_key is not None else -(2**63) - 1


def _prepare_batch(
    envelopes: Sequence[Envelope], lease: Lease | None, settings: OutboxSettings
) -> list[dict[str, Any]]:
    """:func:`_message` for each envelope; a refusal says which one (its index)."""
    if isinstance(envelopes, Envelope | str | bytes | Mapping):
        raise InvalidMessage(
            "envelopes",
            f"is a {type(envelopes).__name__}: pass a list of Envelopes (emit takes one)",
        )
    prepared = []
    for index, envelope in enumerate(envelopes):
        try:
            prepared.append(_message(envelope, lease, settings))
        except InvalidMessage as exc:
            # The cause of the first refusal (pydantic's, a codec's) stays the cause.
            raise InvalidMessage(exc.field, exc.reason, index=index) from exc.__cause__ or exc
    return prepared


def _prepare(
    envelope: Envelope, lease: Lease | None, settings: OutboxSettings, notify: bool
) -> tuple[str, dict[str, Any]]:
    """:func:`emit`'s statement and its parameters."""
    return driver_sql("outbox.db", "emit", settings.schema_name), _message(
        envelope, lease, settings
    ) | _common(lease, settings, notify)


def _message(envelope: Envelope, lease: Lease | None, settings: OutboxSettings) -> dict[str, Any]:
    """One message's columns (and lock key); every check that can reject the message runs
    here, before anything reaches the caller's transaction."""
    if not isinstance(envelope, Envelope):
        raise InvalidMessage(
            "envelope", f"is a {type(envelope).__name__}, not an outbox.Envelope: build one"
        )
    if lease is not None:
        if envelope.run_id is None:
            envelope = envelope.model_copy(update={"run_id": lease.run_id})
        elif envelope.run_id != lease.run_id:
            raise InvalidMessage(
                "run_id",
                f"is {envelope.run_id} but the lease is on run {lease.run_id}: emit with the "
                "lease of the run the message belongs to",
            )
    message = encode(envelope, settings)
    failpoint("outbox.before_emit")
    return {
        "lock_key": ordering_lock_key(message.topic, message.key),
        "message_id": message.message_id,
        "topic": message.topic,
        "key": message.key,
        "lane": lane_for(message.key, message.message_id, settings.lanes),
        "type": message.type,
        "payload": message.payload,
        "headers": _headers_json(message.headers),
        "run_id": message.run_id,
    }


# json.dumps with options builds a new encoder per call; one encoder serves every message.
_headers_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _outcome(row: Row[Any], params: dict[str, Any], lease: Lease | None) -> uuid.UUID:
    if lease is not None and not row.fenced:
        raise LeaseLost(lease.run_id, lease.token)
    message_id: uuid.UUID = params["message_id"]
    return message_id


def _translated(exc: ProgrammingError, settings: OutboxSettings | None) -> Exception:
    return missing_schema(exc, settings) or exc


def _common(lease: Lease | None, settings: OutboxSettings, notify: bool) -> dict[str, Any]:
    """The parameters every statement shares: the wake-up's, and the lease's fence."""
    return {
        # False: the statement never reaches pg_notify (a transaction to be prepared).
        "notify": notify,
        "channel": settings.notify_channel,
        "idle_seconds": settings.relay_idle_seconds,
        # No lease: a NULL run id, and the statements skip their fence.
        "fence_run_id": lease.run_id if lease is not None else None,
        "lease_token": lease.token if lease is not None else None,
        "lease_version": lease.version if lease is not None else None,
    }


def _batch(
    messages: list[dict[str, Any]], lease: Lease | None, settings: OutboxSettings, notify: bool
) -> tuple[str, dict[str, Any]]:
    """:func:`emit_many`'s statement and its parameters: one array per column.

    The rows go in lock order (a stable sort, so one key's messages keep the order given),
    and the locks are the distinct lock keys, ascending: the one global order. What the
    statement (outbox/db/queries.sql: ``emit_many``) does with them:

    * ``locked`` takes one lock per distinct key, in the order of the ``locks`` array
      (ascending, sorted in Python). Why that order is guaranteed: a ``WITH ORDINALITY``
      scan yields its rows in ``ord`` order and PostgreSQL knows it (the plan satisfies
      ``ORDER BY l.ord`` with no Sort node), and the select list is evaluated on each row as
      it leaves the scan; were a Sort ever planned, a volatile function of the select list is
      evaluated after it (PostgreSQL >= 9.6). So lock *n* is asked for only while lock *n-1*
      is held. MATERIALIZED: computed once, never inlined into the INSERT's plan.
    * ``inserted`` reads ``locked`` in its WHERE through an uncorrelated subquery: a one-time
      filter, evaluated before the INSERT's first row, so every lock is held before any id
      is drawn. The id is the column's default (never listed here), evaluated above
      ``ORDER BY m.ord``, i.e. in the order rows reach the insert: lock order, and the order
      given within a key.
    * Arrays go in binary (``%(x)b``): psycopg's text format escapes every bytea and JSON
      string, which cost more than the INSERT itself.
    * ``woken`` notifies each lane once, only while a relay is idle (and *notify*).
    """
    rows = sorted(messages, key=_lock_order)
    locks = _locks(rows, settings)
    params = _common(lease, settings, notify) | {
        "locks": locks,
        "message_ids": [m["message_id"] for m in rows],
        "topics": [m["topic"] for m in rows],
        "keys": [m["key"] for m in rows],
        "lanes": [m["lane"] for m in rows],
        "types": [m["type"] for m in rows],
        "payloads": [m["payload"] for m in rows],
        "headers": [m["headers"] for m in rows],
        "run_ids": [m["run_id"] for m in rows],
    }
    return driver_sql("outbox.db", "emit_many", settings.schema_name), params


def _locks(messages: list[dict[str, Any]], settings: OutboxSettings) -> list[int]:
    """The batch's distinct lock keys, ascending; refused past ``emit_many_max_keys``.

    Every lock stays in PostgreSQL's shared lock table until commit, and the table is sized
    for ~64 locks per connection: a batch of tens of thousands of keys fails with "out of
    shared memory", and while it holds them other sessions can fail to take any lock. A
    bound, not chunking: the locks are transaction-scoped, so splitting the statement frees
    nothing before commit, and locking fewer (coarser) keys would have to change what every
    single emit locks too.
    """
    locks = sorted({m["lock_key"] for m in messages if m["lock_key"] is not None})
    bound = settings.emit_many_max_keys
    if len(locks) > bound:
        raise InvalidMessage(
            "envelopes",
            f"{len(locks)} distinct (topic, key) pairs in one call; emit_many takes at most "
            f"{bound} (emit_many_max_keys, OUTBOXKIT_EMIT_MANY_MAX_KEYS), since each holds a "
            "lock in PostgreSQL's shared lock table until commit. Emit them in several "
            f"transactions of at most {bound} keys each (several calls in one transaction hold "
            "every lock until its commit too), or raise the setting together with the "
            "server's max_locks_per_transaction; nothing was sent",
        )
    return locks


def _batch_outcome(
    row: Row[Any], messages: list[dict[str, Any]], lease: Lease | None
) -> list[uuid.UUID]:
    if lease is not None and not row.fenced:
        raise LeaseLost(lease.run_id, lease.token)
    return [m["message_id"] for m in messages]

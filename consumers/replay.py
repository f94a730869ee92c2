"""Replaying dead-lettered messages once their cause is fixed (for ``outbox`` commands).

Two ways, both recorded in the failures table (status ``replayed``):

* :func:`republish` sends the exact bytes received back to the original topic: the message
  takes the normal path (and its retries) again. Its dedup mark — written when it was
  dead-lettered, so redeliveries were dropped — is removed first, else it would be dropped.
* :func:`rehandle` runs the app's handler on it now, in one transaction with its mark.
"""

from __future__ import annotations

from sqlalchemy import Engine

from consumers import failures
from consumers.app import Consumer
from consumers.deadletter import ERROR_HEADERS, KafkaSender, Sent
from consumers.decode import decode
from consumers.errors import FailureNotFound, NotDeadLettered
from dedup.inbox import Mark, mark, unmark
from outbox.kafka import Record
from outbox.settings import OutboxSettings


def _load(engine: Engine, failure_id: int) -> failures.FailedMessage:
    with engine.connect() as conn:
        found = failures.get_failure(conn, failure_id)
    if found is None:
        raise FailureNotFound(failure_id)
    return found


def republish(
    engine: Engine,
    sender: KafkaSender,
    failure_id: int,
    *,
    settings: OutboxSettings | None = None,
    again: bool = False,
    actor: str | None = None,
) -> Sent:
    """Send failure *failure_id*'s message to its original topic again; return where it went.

    Only a dead-lettered failure, and only once: it is marked ``replayed`` (with its dedup
    mark removed) before it is sent, by a compare-and-set, so two operators replaying it at
    the same moment send it once (the other gets :class:`NotDeadLettered`); a send that fails
    puts both back as they were. A process killed between that commit and the send leaves it
    ``replayed`` and not sent: *again* replays a ``replayed`` one too (`outbox dlq replay
    --again`), a person's decision that it was not sent (or that twice is harmless).
    *actor*: who replays it, kept on the failure.
    *engine* must carry the schema translate map (``outbox.db.schema.translate``).
    """
    with engine.begin() as conn:
        before = failures.get_failure(conn, failure_id, lock=True)
        if before is None:
            raise FailureNotFound(failure_id)
        failure = failures.take_for_replay(conn, failure_id, again=again, actor=actor)
        if failure is None:
            raise NotDeadLettered(failure_id, before.status)
        unmarked = failure.message_id is not None and unmark(
            conn, failure.consumer_group, failure.message_id, settings=settings)
    headers = [
        (name, value.encode())
        for name, value in failure.headers.items()
        if name not in ERROR_HEADERS
    ]
    try:
        return sender.send(failure.topic, key=failure.key, value=failure.payload,
                           headers=headers)
    except BaseException:
        with engine.begin() as conn:
            # Not sent: put back the status, and the mark if there was one (a mark that was
            # never there would drop the message's real redeliveries).
            failures.give_back(conn, before)
            if unmarked:
                assert failure.message_id is not None
                mark(conn, failure.consumer_group,
                     Mark(failure.message_id, failure.topic, failure.partition, failure.offset),
                     settings=settings)
        raise


def rehandle(app: Consumer, engine: Engine, failure_id: int, *,
             actor: str | None = None) -> None:
    """Run *app*'s handler on failure *failure_id*'s message now; its effect commits with
    its dedup mark and the ``replayed`` status, or (if it raises) not at all."""
    failure = _load(engine, failure_id)
    record = Record(
        topic=failure.topic,
        partition=failure.partition,
        offset=failure.offset,
        timestamp=-1,  # not kept in the failures table
        key=failure.key,
        value=failure.payload,
        headers=[(n, v.encode()) for n, v in failure.headers.items()],
    )
    registration = app.registrations.get(failure.topic)
    decoded = decode(record, registration)
    assert registration is not None
    settings = app.outbox_settings
    with engine.begin() as conn:
        unmark(conn, app.group_id, decoded.message_id, settings=settings)
        mark(
            conn,
            app.group_id,
            Mark(decoded.message_id, failure.topic, failure.partition, failure.offset),
            settings=settings,
        )
        ctx = decoded.context(conn, app.group_id, app.outbox_settings)
        if registration.batch_handler is not None:
            registration.batch_handler([(ctx, decoded.payload)])
        else:
            assert registration.handler is not None
            registration.handler(ctx, decoded.payload)
        # Only if still dead-lettered (someone may have replayed or discarded it since it was
        # read): else this transaction, the handler's effect with it, rolls back.
        if failures.take_for_replay(conn, failure_id, actor=actor) is None:
            raise NotDeadLettered(failure_id, "replayed or discarded meanwhile", "re-handle")

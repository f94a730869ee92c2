"""What a handler gets besides its payload: the transaction and the message's coordinates."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, TableClause

from consumers.deferred import DeferredInserts
from dedup.ledger import Ledger, OnSettle, Operation, ReconcilePolicy, System
from dedup.ledger.reconcile import DEFAULT_POLICY
from outbox.db.bulk import insert_rows
from outbox.messages.emit import emit
from outbox.messages.envelope import Envelope
from outbox.runs.confirm import Outcome, apply_confirmation
from outbox.settings import OutboxSettings

_new = object.__new__


@dataclass(frozen=True)
class HandlerContext:
    """The message being handled and the transaction its effects must be written in.

    ``conn`` is the connection of the transaction that also writes the message's dedup mark:
    everything written through it commits together with the mark, or not at all. Never
    commit or roll it back yourself; raise instead (see :mod:`consumers.control`).
    """

    conn: Connection
    group_id: str
    message_id: str
    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: Mapping[str, bytes] = field(default_factory=dict)
    run_id: uuid.UUID | None = None
    outbox_settings: OutboxSettings | None = None

    @classmethod
    def of(
        cls,
        *,
        conn: Connection,
        group_id: str,
        message_id: str,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        headers: Mapping[str, bytes],
        run_id: uuid.UUID | None,
        outbox_settings: OutboxSettings | None,
        deferred: DeferredInserts | None = None,
    ) -> HandlerContext:
        """The consumer's constructor, one call per message: every field given, so the
        frozen dataclass's ``__init__`` (a guarded ``object.__setattr__`` per field, most of
        the cost) is skipped. The result is the same frozen object.

        *deferred*: where :meth:`defer_insert` keeps rows until the consumer writes them
        (batch mode); without it they are inserted at the call.
        """
        self = _new(cls)
        self.__dict__.update(
            conn=conn,
            group_id=group_id,
            message_id=message_id,
            topic=topic,
            partition=partition,
            offset=offset,
            key=key,
            headers=headers,
            run_id=run_id,
            outbox_settings=outbox_settings,
            _deferred=deferred,  # not a field: not compared, not shown
        )
        return self

    @classmethod
    def factory(
        cls,
        conn: Connection,
        group_id: str,
        outbox_settings: OutboxSettings | None,
        deferred: DeferredInserts | None = None,
    ) -> Callable[[str, str, int, int, bytes | None, Mapping[str, bytes], uuid.UUID | None],
                  HandlerContext]:
        """:meth:`of` for the messages of one transaction: what they share is given once,
        and each context is (message_id, topic, partition, offset, key, headers, run_id).
        A batch makes one per message; this is a third cheaper per context than :meth:`of`."""
        set_dict = object.__setattr__

        # Positional: keywords would cost a dict per call, and only decode.contexts calls it.
        def make(  # noqa: PLR0917
            message_id: str, topic: str, partition: int, offset: int, key: bytes | None,
            headers: Mapping[str, bytes], run_id: uuid.UUID | None,
        ) -> HandlerContext:
            self = _new(cls)
            set_dict(self, "__dict__", {
                "conn": conn, "group_id": group_id, "message_id": message_id, "topic": topic,
                "partition": partition, "offset": offset, "key": key, "headers": headers,
                "run_id": run_id, "outbox_settings": outbox_settings, "_deferred": deferred,
            })
            return self

        return make

    def defer_insert(self, table: TableClause, row: Mapping[str, Any]) -> None:
        """Insert *row* into *table* later, with the batch's other rows, before the commit.

        The fast way to write one row per message: in batch mode the batch's rows of a
        table are sent in one ``INSERT`` after its handlers ran, instead of one round trip
        per message (each column's values as one array literal where their types allow,
        :mod:`outbox.db.bulk`; else SQLAlchemy's multi-row ``INSERT``). What you give
        up: no result or row count, a later statement of this batch does not see the row,
        and an error in it (a unique violation) is raised when the rows are written, not
        here. The consumer then rolls the batch back and handles it again, each message
        in a savepoint with its own rows written at its end, so the error is charged to
        the right message and nothing of the failed attempt is committed. Outside batch
        mode (per-message mode, ``rehandle``) the row is inserted now. Use
        ``ctx.conn.execute`` when you need the answer.

        Args:
            table: a SQLAlchemy ``Table`` (or ``sqlalchemy.table(...)``).
            row: column name to value; rows of one table with the same columns are
                written in one statement, in the order deferred. A name that is not one
                of *table*'s columns raises ValueError (when the rows are written).
        """
        deferred: DeferredInserts | None = self.__dict__.get("_deferred")
        if deferred is None:
            insert_rows(self.conn, table, [row])
        else:
            deferred.add(table, row)

    def emit(self, envelope: Envelope) -> uuid.UUID:
        """Emit a follow-up message through the outbox in this message's transaction.

        The follow-up is caused by this message: ``causation_id`` defaults to its id. It is
        published only if the handler's transaction commits, and exactly then.
        """
        if envelope.causation_id is None:
            envelope = envelope.model_copy(update={"causation_id": self.message_id})
        return emit(self.conn, envelope, settings=self.outbox_settings)

    def confirm(
        self,
        *,
        outcome: Outcome,
        evidence: Any,
        run_id: uuid.UUID | None = None,
        reason: str | None = None,
    ) -> bool:
        """Move the waiting run on (default: the message's ``run-id``) in this transaction.

        The confirmation id is the message id and the actor the consumer group, so a
        redelivery changes nothing. Returns False if it was applied before.
        """
        target = run_id or self.run_id
        if target is None:
            raise ValueError("the message has no run-id header: pass run_id=")
        return apply_confirmation(
            self.conn,
            run_id=target,
            confirmation_id=self.message_id,
            outcome=outcome,
            evidence=evidence,
            actor=self.group_id,
            reason=reason,
            settings=self.outbox_settings,
        )

    def perform(
        self,
        *,
        system: System,
        operation: str,
        request: Any,
        key: str | None = None,
        run_id: uuid.UUID | None = None,
        on_settle: OnSettle | str = OnSettle.FINISH,
        policy: ReconcilePolicy = DEFAULT_POLICY,
    ) -> Operation:
        """Do *operation* on *system* at most once for this message:
        :meth:`dedup.ledger.Ledger.perform` with the handler's engine and settings, the key
        derived from the message id (or *key*), and the consumer group as the actor.

        Not in the handler's transaction: perform commits the intent before the call and
        the outcome after it, each in a transaction of its own on another connection of
        the same engine, so they stay recorded whether the handler's transaction commits
        or rolls back. A redelivery (after a rollback, a crash, a retry) calls this again
        and gets the operation as recorded, or reconciled by a status query, never a
        second call. So act on ``result.status`` here: commit (return) once it is settled,
        raise :class:`~consumers.control.RetryLater` while it is ``pending`` or
        ``unknown``. With *run_id* the run is settled with the operation, in perform's
        transaction (*on_settle*: ``"finish"`` or ``"resume"``); ``ctx.run_id`` is the
        message's run. Do not write that run through ``ctx.conn`` before calling: the
        handler's transaction would then hold its row lock, and perform's settling
        transaction would wait for it for ever.

        One key per (message, operation): a second call with the same *operation* and a
        different *request* raises :class:`~dedup.ledger.RequestMismatch`; pass *key* to
        do two such operations for one message.
        """
        return Ledger(settings=self.outbox_settings).perform(
            self.conn.engine,
            system=system,
            operation=operation,
            request=request,
            message_id=self.message_id,
            key=key,
            run_id=run_id,
            on_settle=on_settle,
            policy=policy,
            actor=self.group_id,
        )

"""Handling records with their dedup marks: the exactly-once-effect core of the consumer.

For each message, in one PostgreSQL transaction: insert its mark (group, message id); if
it was already there, the message is a duplicate and is dropped; otherwise the handler runs
on that same transaction, so its writes and the mark commit together. The caller commits
Kafka offsets only after the processor reported the commit (``committed``), so a crash in
between redelivers messages whose marks are there: dropped.

Batch mode puts a poll batch in one transaction: the marks in one statement, then the
handlers without savepoints, then the rows they deferred (``ctx.defer_insert``,
:mod:`consumers.deferred`), then the commit. If anything fails, that transaction is rolled
back and the batch is handled again with a savepoint per message (per-message handlers) or
per bisected chunk (batch handlers), each writing its deferred rows before its savepoint
ends, so a failing message is rolled back alone and its error is its own. The batch then
commits what came before it and the failing message is settled by :mod:`consumers.retries`:
counted, then *parked* (nothing after it in its partition is handled, its partition waits
until the retry is due, while the batch goes on with the other partitions) or dead-lettered.
A retry is handled alone, before the rest of its batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, RootTransaction
from sqlalchemy.exc import IntegrityError

from consumers import failures
from consumers.app import Consumer
from consumers.control import SkipMessage
from consumers.decode import Decoded, Decoding, contexts, decode, decode_many
from consumers.deferred import DeferredInserts
from consumers.errors import MalformedMessage
from consumers.handlers import Registration
from consumers.metrics import ConsumerMetrics
from consumers.parking import Parked
from consumers.retries import Committed, Retries, SendDeadLetter
from dedup.inbox import (
    Mark,
    Marks,
    commit_then_insert_new,
    insert_new,
    mark,
    mark_many,
    unmark,
)
from outbox.kafka import Record
from outbox.messages.envelope import HEADER_RUN_ID
from outbox.runtime import tracing
from outbox.runtime.failpoints import failpoint

log = logging.getLogger(__name__)


class _HandlerFailed(Exception):
    """A handler raised inside the unguarded (savepoint-free) batch; carries where."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


@dataclass
class _Failed:
    index: int
    error: BaseException


@dataclass(frozen=True)
class Progress:
    """What :meth:`Processor.process` did with a batch.

    ``handled``: records done for good (committed, dropped as duplicates, skipped or
    dead-lettered). ``parked``: failed messages to retry later; nothing after one of them in
    its partition was handled.
    """

    handled: int
    parked: tuple[Parked, ...] = ()


Position = tuple[str, int, int]  # (topic, partition, offset)

HOLD_IDLE_S = 10.0
"""A batch connection unused this long is given back and another taken (pinged)."""


def _no_commit(records: Sequence[Record]) -> None:
    pass


_Offer = tuple[Sequence[Record], Decoding, object]  # records, decoding, the batch followed
_ANY = 0  # the key of an offer to whichever commit comes next (no object's id is 0)


@dataclass(frozen=True)
class _Ahead:
    """The next batch's marks, inserted with the last batch's commit: its transaction is
    open on the kept connection (``tx``) until that batch is handled in it or withdrawn."""

    records: Sequence[Record]
    decoding: Decoding
    conn: Connection
    tx: RootTransaction


class Processor:
    """Processes records in order; ``committed`` is called after each database commit."""

    def __init__(
        self,
        app: Consumer,
        engine: Engine,
        metrics: ConsumerMetrics,
        send_dead_letter: SendDeadLetter,
        *,
        stop: threading.Event | None = None,
        committed: Committed = _no_commit,
        keep_connection: bool = False,
    ) -> None:
        """*keep_connection*: plain batches run on one connection, kept from one batch to the
        next (see :meth:`_batch_connection`); the owner then calls :meth:`release` at its
        end. Otherwise each batch takes one from the pool."""
        self.app = app
        self.settings = app.settings
        self.group = app.group_id
        self.engine = engine
        self.metrics = metrics
        self.stop = stop or threading.Event()
        self.committed = committed
        self.retries = Retries(app, engine, metrics, send_dead_letter, committed)
        self._traced = tracing.enabled()
        self._keep = keep_connection
        self._held: Connection | None = None  # see _batch_connection
        self._held_since = 0.0
        # The batches the loop will hand over next, each offered to the commit of the batch
        # it follows (see offer), and the batch whose marks went in with this one's commit.
        # Offers are made by the loop's thread and taken by the handler thread's commit,
        # under the lock; nothing else on the handler thread touches them (withdraw, a
        # dropped connection). Keyed by id() of the batch followed (_ANY: the next commit).
        self._offers: dict[int, _Offer] = {}
        self._offer_lock = threading.Lock()
        self._key: object = None  # the batch being processed, as offers name it
        self._ahead: _Ahead | None = None

    # --- the entry point -----------------------------------------------------------------
    def process(
        self,
        records: Sequence[Record],
        retries: Collection[Position] = (),
        unsure: Sequence[Position] = (),
        decoded: Decoding | None = None,
        *,
        key: object = None,
    ) -> Progress:
        """Handle *records* in partition order; park failed ones instead of waiting for them.

        *retries*: positions of records that are retries of parked messages; each is handled
        alone, first (it is the first record of its partition in the batch). *unsure*: first
        records of partitions read from elsewhere than where this process left them (its
        start, a rebalance, a rewind): those an earlier process parked (their failure row
        says ``retrying``) are retries too, so that handling them marks them ``recovered``.
        *decoded*: :func:`decode_many` of *records*, when the caller decoded them already
        (the runner's loop does, while the batch before is in the database). *key*: the
        batch as the offer of the one behind it names it (:meth:`offer`'s *after*).
        """
        self._key = key
        try:
            return self._process(records, retries, unsure, decoded)
        except BaseException:
            self.withdraw()  # marks inserted ahead (with a commit of this call) go at once
            raise
        finally:
            self._key = None

    def _process(
        self,
        records: Sequence[Record],
        retries: Collection[Position],
        unsure: Sequence[Position],
        decoded: Decoding | None,
    ) -> Progress:
        # Whether spans are made, looked up once per batch rather than per message: a
        # tracer provider set meanwhile is picked up from the next batch on.
        self._traced = tracing.enabled()
        if unsure:
            with self.engine.connect() as conn:
                retries = {*retries, *failures.retrying_among(conn, group=self.group,
                                                              positions=unsure)}
        parked: list[Parked] = []
        pending = list(records)
        handled = 0
        heads = [r for r in pending if (r.topic, r.partition, r.offset) in retries] if (
            retries) else []
        ahead = self._ahead
        if ahead is not None and (heads or ahead.records is not records
                                  or ahead.decoding is not decoded or self.stop.is_set()):
            # Not the batch whose marks went in ahead (the loop kept part of it, a retry goes
            # first on another connection, or stopping): those marks are rolled back first.
            self.withdraw()
        for record in heads:
            if self.stop.is_set():
                return Progress(handled, tuple(parked))
            error = self.handle_one(record, recovering=True)
            again = None if error is None else self.retries.settle(record, error)
            if again is None:
                handled += 1
                pending.remove(record)
            else:
                parked.append(again)
                pending = _without_partition(pending, record)
        while pending and not self.stop.is_set():
            if self.settings.mode == "batch":
                # *decoded* is of the whole batch: of use while no retry went first.
                whole = len(pending) == len(records)
                ok, failed = self._batch(pending, decoded if whole else None, last=whole)
                decoded = None
            else:
                ok, failed = self._one_by_one(pending)
            handled += ok
            if failed is None:
                pending = pending[ok:]
                continue
            bad, rest = pending[ok], pending[ok + 1 :]
            again = self.retries.settle(bad, failed.error)
            if again is None:
                handled += 1
                pending = rest
            else:
                parked.append(again)
                pending = _without_partition(rest, bad)
        return Progress(handled, tuple(parked))

    # --- batch mode ----------------------------------------------------------------------
    def _batch(
        self, records: Sequence[Record], decoding: Decoding | None = None, *,
        last: bool = False,
    ) -> tuple[int, _Failed | None]:
        """*last*: nothing of this :meth:`process` call comes after this batch if it goes
        through whole, so its commit may take the next batch's marks (:meth:`offer`)."""
        decoded, malformed = decoding or decode_many(records, self.app.registrations)
        failed = None if malformed is None else _Failed(len(decoded), malformed)
        if not decoded:
            return 0, failed
        plain = self._plain(decoded, mark_next=last and malformed is None)
        if plain is None:
            self.committed(records[: len(decoded)])
            return len(decoded), failed
        index, error = plain
        # The messages before the failing one succeed again without it: commit them, then
        # the failing one is settled alone (retried, counted, maybe dead-lettered).
        if (index >= 0 and not isinstance(error, SkipMessage)
                and (index == 0 or self._plain(decoded[:index]) is None)):
            self.committed(records[:index])
            return index, _Failed(index, error)
        with self.engine.connect() as conn, conn.begin():
            fresh, duplicates = self._mark_careful(conn, decoded)
            for d in duplicates:
                self._duplicate(d)
            ok, inner = self._handle_guarded(conn, fresh)
            if inner is not None:
                # Stop at the failing message: unmark it and everything after it in the batch.
                for d in fresh[inner.index :]:
                    unmark(conn, self.group, d.message_id, settings=self.app.outbox_settings)
                stop_at = decoded.index(fresh[inner.index])
                failed = _Failed(stop_at, inner.error)
                count_to = stop_at
            else:
                count_to = len(decoded)
        self._done(fresh[:ok])
        self.committed(records[:count_to])
        return count_to, failed

    def _plain(
        self, decoded: list[Decoded], *, mark_next: bool = False
    ) -> tuple[int, BaseException] | None:
        """The common case first: the batch in one transaction without savepoints.

        A savepoint costs two round trips per message and almost no batch has a failure,
        so the batch runs plainly. ``None`` means it committed. Otherwise everything was
        rolled back and the answer is (index in *decoded* of the message whose handler
        raised, or -1 when that is not known, and the error). Handlers' database writes roll
        back with it; their outside effects must be idempotent anyway (the operations
        ledger), as with any redelivery.

        The batch's marks may be in already, inserted with the last batch's commit
        (``_ahead``); and with *mark_next*, this commit takes the next batch's marks if the
        loop offered it (:meth:`offer`): a round trip per batch fewer.
        """
        fresh: list[Decoded] = decoded
        duplicates: list[Decoded] = []
        deferred = DeferredInserts()
        conn, tx = self._take_ahead(decoded)
        marked = tx is not None  # the marks are in, in this transaction
        clean = False  # the transaction ended as asked: the connection is kept
        try:
            if tx is None:
                tx = conn.begin()
            try:
                if not marked and not self._all_new(conn, decoded):
                    tx.rollback()  # some were marked: the careful insert says which
                    tx = conn.begin()
                    fresh, duplicates = self._mark_careful(conn, decoded)
                self._handle_unguarded(conn, fresh, deferred)
                # An error in a deferred row names no message (-1, below): the careful
                # path writes each message's rows in its savepoint and finds it.
                deferred.write(conn)
                failpoint("consumer.after_handler")
                following = self._offered() if mark_next and not duplicates else None
                if following is None:
                    tx.commit()
                else:
                    self._commit_marking(conn, tx, following)
            except _HandlerFailed as failure:
                tx.rollback()
                if conn.invalidated:
                    # The connection broke under the handler: while it held the marks
                    # between batches (the handler's statement was its first use since), or
                    # the server went away meanwhile. Not the message's failure, and no
                    # attempt of it: the careful path decides, on another connection.
                    return -1, failure.error
                clean = True
                index = -1 if failure.index < 0 else decoded.index(fresh[failure.index])
                return index, failure.error
            except Exception as exc:  # deferred rows or the commit: let the careful path decide
                tx.rollback()
                return -1, exc
            clean = True
        finally:
            if not (clean and self._keep):
                self._drop_connection()  # maybe broken: the next batch takes another, pinged
        for d in duplicates:
            self._duplicate(d)
        self._done(fresh)
        return None

    def _take_ahead(self, decoded: list[Decoded]) -> tuple[Connection, RootTransaction | None]:
        """The connection for *decoded*'s plain transaction, and that transaction if the
        batch's marks went in ahead (None: begin one and insert them)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.decoding[0] is decoded:
            self._held_since = time.monotonic()
            return ahead.conn, ahead.tx
        if ahead is not None:  # not this batch (process() withdraws those first)
            with suppress(Exception):
                ahead.tx.rollback()
        return self._batch_connection(), None

    # --- the next batch's marks with this one's commit ----------------------------------
    def offer(
        self, records: Sequence[Record] | None, decoding: Decoding | None = None, *,
        after: object = None,
    ) -> None:
        """A batch the loop polled behind one handed over, decoded; None: no offers at all.

        Called on the loop's thread while the handler thread handles the batches before: if
        the commit of the batch it follows (*after*: its *key* in :meth:`process`; None:
        whichever batch commits next) comes after the offer, that commit inserts these marks
        in the same round trip (``COMMIT; BEGIN; INSERT``), and the batch, handed over next
        as offered, is handled in that transaction. The loop must hand it over as offered,
        or have :meth:`withdraw` run on the handler thread, before anything else: its marks'
        row locks would hold up whoever reads these messages next.
        """
        with self._offer_lock:
            if records is None or decoding is None:
                self._offers.clear()
            else:
                self._offers[_ANY if after is None else id(after)] = (records, decoding, after)

    def retract_offer(self, records: Sequence[Record]) -> None:
        """The offer of *records* withdrawn, if it still stands: that batch is being handed
        over, and no commit but that of the batch before it may take its marks."""
        with self._offer_lock:
            for slot, offer in list(self._offers.items()):
                if offer[0] is records:
                    del self._offers[slot]

    def _offered(self) -> tuple[Sequence[Record], Decoding] | None:
        """The batch offered to this commit if its marks can go in with it (on the kept
        connection, all decoded, no id twice: what the plain insert takes); taken, so that
        one offer goes with one commit at most."""
        key = self._key
        with self._offer_lock:  # an offer made meanwhile is not cleared unseen
            offer = self._offers.get(id(key)) if key is not None else None
            if offer is not None and offer[2] is key:
                del self._offers[id(key)]
            else:
                offer = self._offers.pop(_ANY, None)
        if offer is None or not self._keep or self.settings.mode != "batch":
            return None
        decoded, malformed = offer[1]
        if malformed is not None or not decoded or (
                len({d.message_id for d in decoded}) < len(decoded)):
            return None
        return offer[0], offer[1]

    def _commit_marking(
        self, conn: Connection, tx: RootTransaction, following: tuple[Sequence[Record], Decoding]
    ) -> None:
        """Commit *tx* with the *following* batch's marks in the same round trip."""
        records, decoding = following
        marked = commit_then_insert_new(conn, self.group, _marks(decoding[0]),
                                        settings=self.app.outbox_settings)
        if marked is None:
            tx.commit()
        elif marked:
            self._ahead = _Ahead(records, decoding, conn, tx)  # tx is the next batch's now
        else:
            # Committed; a mark of the next batch was there already (a redelivery): that
            # transaction is rolled back and the batch goes the usual way.
            tx.rollback()

    def withdraw(self) -> None:
        """Roll back the marks inserted ahead for a batch that will not be handled as offered
        (on the handler thread, which owns the connection).

        Only those: the loop may have offered its next batch meanwhile (a withdraw it
        submitted runs after that, or process() withdraws while the batch behind is offered
        already), and that offer stands. What is ahead when this runs is the withdrawn
        batch's: the handler thread runs the loop's tasks in the order submitted, and only a
        commit of a batch handed over after the withdrawn one could put another there.
        """
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            ahead.tx.rollback()
        except Exception:  # broken: the connection goes, and its transaction with it
            self._drop_connection()

    def _batch_connection(self) -> Connection:
        """The connection plain batches run on, kept from one batch to the next: no pool
        checkout and no ping (a round trip, then a wait for the interpreter's lock) per
        batch. After an idle spell it is given back and another taken, pinged, as the pool
        would (a server or a firewall may have dropped it meanwhile)."""
        now = time.monotonic()
        held = self._held
        if held is not None and (held.invalidated or now - self._held_since > HOLD_IDLE_S):
            self._drop_connection()
            held = None
        if held is None:
            held = self._held = self.engine.connect()
        self._held_since = now
        return held

    def release(self) -> None:
        """Give the kept batch connection back to the pool (the runner does at its end,
        its loop and handler thread done); marks inserted ahead are rolled back with it."""
        self.offer(None)
        self._drop_connection()

    def _drop_connection(self) -> None:
        """The kept connection given back (maybe broken: the pool drops it), and with it the
        marks inserted ahead; an offer stands (the loop's, see :meth:`offer`)."""
        self._ahead = None
        held, self._held = self._held, None
        if held is not None:
            with suppress(Exception):  # broken: the pool drops it
                held.close()

    def _mark_careful(
        self, conn: Connection, decoded: list[Decoded]
    ) -> tuple[list[Decoded], list[Decoded]]:
        """Mark the batch with ``ON CONFLICT DO NOTHING``: (fresh, duplicates) in order."""
        new = mark_many(conn, self.group, _marks(decoded), settings=self.app.outbox_settings)
        fresh: list[Decoded] = []
        duplicates: list[Decoded] = []
        for d in decoded:
            if d.message_id in new:
                new.discard(d.message_id)  # a second copy in this batch is a duplicate
                fresh.append(d)
            else:
                duplicates.append(d)
        return fresh, duplicates

    def _all_new(self, conn: Connection, decoded: list[Decoded]) -> bool:
        """Mark the batch with a plain INSERT, the common case; False if a mark was there
        (a redelivery; the transaction is then aborted and must be rolled back)."""
        if len({d.message_id for d in decoded}) < len(decoded):
            return False  # an id twice in the batch: the plain insert would refuse it anyway
        try:
            insert_new(conn, self.group, _marks(decoded), settings=self.app.outbox_settings)
        except IntegrityError:
            return False
        return True

    # --- calling handlers: one call, all unguarded, all guarded ---------------------------
    def _calls(self, items: list[Decoded]) -> Iterator[tuple[int, Registration, list[Decoded]]]:
        """*items* as handler calls: (index of the first item, registration, the items).

        A per-message handler takes one item; a batch handler its topic's consecutive run.
        """
        registrations = self.app.registrations
        index = 0
        while index < len(items):
            topic = items[index].record.topic
            registration = registrations[topic]
            end = index + 1
            if registration.batch_handler is not None:
                while end < len(items) and items[end].record.topic == topic:
                    end += 1
            yield index, registration, items[index:end]
            index = end

    def _handle(
        self,
        conn: Connection,
        registration: Registration,
        items: list[Decoded],
        deferred: DeferredInserts | None,
    ) -> None:
        """One handler call on *conn*: a per-message handler on its item, a batch handler on
        its run; rows it defers go to *deferred* (None: inserted at once)."""
        settings = self.app.outbox_settings
        # No span to make when tracing is off (spans cost a provider lookup per message).
        with self._span(items) if self._traced else nullcontext() as span:
            if span is not None:
                tracing.set_attributes(span, self._span_attributes(items))
            if registration.batch_handler is not None:
                context = contexts(conn, self.group, settings, deferred)
                registration.batch_handler([(context(d), d.payload) for d in items])
                return
            assert registration.handler is not None
            (item,) = items
            registration.handler(item.context(conn, self.group, settings, deferred), item.payload)

    def _handle_unguarded(
        self, conn: Connection, items: list[Decoded], deferred: DeferredInserts
    ) -> None:
        """Every handler of *items*, in order, without savepoints; the first error aborts.

        Raises:
            _HandlerFailed: with the failing item's index, -1 for a batch handler's run of
                several (which message failed is not known).
        """
        if self._traced:
            for start, registration, run in self._calls(items):
                try:
                    self._handle(conn, registration, run, deferred)
                except Exception as exc:
                    raise _HandlerFailed(start if len(run) == 1 else -1, exc) from exc
            return
        # Without spans, the batch's calls in one loop and its contexts from one factory:
        # what _handle does per call costs more than a no-op handler itself.
        context = contexts(conn, self.group, self.app.outbox_settings, deferred)
        for start, registration, run in self._topic_runs(items):
            batch_handler = registration.batch_handler
            if batch_handler is not None:
                try:
                    batch_handler([(context(d), d.payload) for d in run])
                except Exception as exc:
                    raise _HandlerFailed(start if len(run) == 1 else -1, exc) from exc
                continue
            handler = registration.handler
            assert handler is not None
            for index, d in enumerate(run, start):
                try:
                    handler(context(d), d.payload)
                except Exception as exc:
                    raise _HandlerFailed(index, exc) from exc

    def _topic_runs(
        self, items: list[Decoded]
    ) -> Iterator[tuple[int, Registration, list[Decoded]]]:
        """*items* as runs of one topic: (index of the first item, registration, the run)."""
        registrations = self.app.registrations
        start, count = 0, len(items)
        while start < count:
            topic = items[start].record.topic
            end = start + 1
            while end < count and items[end].record.topic == topic:
                end += 1
            yield start, registrations[topic], items[start:end]
            start = end

    def _handle_guarded(
        self, conn: Connection, items: list[Decoded]
    ) -> tuple[int, _Failed | None]:
        """Every handler of *items* in savepoints; stop at the first failure (ok count,
        failure). A batch handler's failing run is bisected down to the failing message."""
        for start, registration, run in self._calls(items):
            bad = self._bisect(conn, registration, run)
            if bad is not None:
                return start + bad.index, _Failed(start + bad.index, bad.error)
        return len(items), None

    def _bisect(
        self, conn: Connection, registration: Registration, items: list[Decoded]
    ) -> _Failed | None:
        error = self._in_savepoint(conn, registration, items)
        if error is None:
            return None
        if len(items) == 1:
            return _Failed(0, error)
        half = len(items) // 2
        first = self._bisect(conn, registration, items[:half])
        if first is not None:
            return first
        second = self._bisect(conn, registration, items[half:])
        return None if second is None else _Failed(half + second.index, second.error)

    def _in_savepoint(
        self, conn: Connection, registration: Registration, items: list[Decoded]
    ) -> BaseException | None:
        """One handler call and its deferred rows in a savepoint; the error, rolled back."""
        deferred = DeferredInserts()
        savepoint = conn.begin_nested()
        try:
            self._handle(conn, registration, items, deferred)
            deferred.write(conn)  # inside the savepoint: an error here is these items'
        except SkipMessage as exc:
            savepoint.rollback()
            if len(items) > 1:
                return exc  # bisect down to the message that asked to be skipped
            self._skipped(items[0], exc)
            return None
        except Exception as exc:
            savepoint.rollback()
            return exc
        savepoint.commit()
        return None

    # --- per-message mode ----------------------------------------------------------------
    def _one_by_one(self, records: Sequence[Record]) -> tuple[int, _Failed | None]:
        for index, record in enumerate(records):
            if self.stop.is_set():
                return index, None
            error = self.handle_one(record, recovering=False)
            if error is not None:
                return index, _Failed(index, error)
        return len(records), None

    def handle_one(
        self, record: Record, *, recovering: bool, conn: Connection | None = None
    ) -> BaseException | None:
        """One message in its own transaction; the error if it failed (nothing committed).

        On *conn* when given (a handler thread's own connection: no pool checkout and no
        ping per message), else on a connection of the pool. Rows its handler defers are
        inserted at the call (there is no batch to join)."""
        registration = self.app.registrations.get(record.topic)
        try:
            decoded = decode(record, registration)
        except MalformedMessage as exc:
            return exc
        assert registration is not None
        if conn is None:
            with self.engine.connect() as pooled:
                return self._one_on(pooled, registration, decoded, recovering)
        return self._one_on(conn, registration, decoded, recovering)

    def _one_on(
        self, conn: Connection, registration: Registration, decoded: Decoded, recovering: bool
    ) -> BaseException | None:
        record, settings = decoded.record, self.app.outbox_settings
        tx = conn.begin()
        try:
            if not mark(conn, self.group, _mark(decoded), settings=settings):
                if recovering:  # handled meanwhile (by another process): recovered too
                    self._recovered(conn, record)
                tx.commit()
                self._duplicate(decoded)
                self.committed([record])
                return None
            try:
                self._handle(conn, registration, [decoded], None)
            except SkipMessage as exc:
                tx.rollback()
                with conn.begin():
                    mark(conn, self.group, _mark(decoded), settings=settings)
                self._skipped(decoded, exc)
                self.committed([record])
                return None
            except Exception as exc:
                tx.rollback()
                return exc
            failpoint("consumer.after_handler")
            if recovering:
                self._recovered(conn, record)
            tx.commit()
        finally:
            if tx.is_active:
                tx.rollback()
        self._done([decoded])
        self.committed([record])
        return None

    def _recovered(self, conn: Connection, record: Record) -> None:
        failures.mark_recovered(
            conn, group=self.group, topic=record.topic, partition=record.partition,
            offset=record.offset,
        )

    # --- tracing and counting ------------------------------------------------------------
    def _span(self, items: list[Decoded]) -> AbstractContextManager[Any]:
        """``outbox.handle``, current around the handler (so its follow-ups join the trace).

        One message: the child of the context in its ``traceparent`` (the relay's publish).
        A batch handler's run: a span linked to each message's context. SkipMessage is an
        outcome, not an error; every other exception sets the span's error status.
        """
        if len(items) == 1:
            return tracing.start_span(
                "outbox.handle", kind="consumer", parent=items[0].headers, ok=(SkipMessage,)
            )
        return tracing.start_span(
            "outbox.handle",
            kind="consumer",
            parent={},  # a new trace: the messages' own traces are linked
            links=[d.headers for d in items],
            ok=(SkipMessage,),
        )

    def _span_attributes(self, items: list[Decoded]) -> dict[str, Any]:
        first = items[0]
        one = len(items) == 1
        return {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": first.record.topic,
            "messaging.consumer.group.name": self.group,
            "messaging.destination.partition.id": str(first.record.partition) if one else None,
            "messaging.kafka.offset": first.record.offset if one else None,
            "messaging.message.id": first.message_id if one else None,
            "messaging.batch.message_count": None if one else len(items),
            "outboxkit.run_id": (
                first.headers.get(HEADER_RUN_ID, b"").decode("utf-8", "replace") or None
                if one
                else None
            ),
        }

    def _duplicate(self, d: Decoded) -> None:
        self.metrics.duplicates.labels(d.record.topic).inc()
        log.debug(
            "dropped duplicate %s (%s[%d]@%d)",
            d.message_id,
            d.record.topic,
            d.record.partition,
            d.record.offset,
            extra={"event": "consumer.duplicate"},
        )

    def _skipped(self, d: Decoded, exc: SkipMessage) -> None:
        self.metrics.skipped.labels(d.record.topic).inc()
        log.info("skipped %s: %s", d.message_id, exc.reason, extra={"event": "consumer.skipped"})

    def _done(self, items: list[Decoded]) -> None:
        if not items:
            return
        topic = items[0].record.topic
        if items[-1].record.topic == topic and all(d.record.topic == topic for d in items):
            self.metrics.processed.labels(topic).inc(len(items))  # the usual batch: one topic
            return
        by_topic: dict[str, int] = {}
        for d in items:
            by_topic[d.record.topic] = by_topic.get(d.record.topic, 0) + 1
        for name, n in by_topic.items():
            self.metrics.processed.labels(name).inc(n)


def _without_partition(records: Sequence[Record], of: Record) -> list[Record]:
    """*records* less those of *of*'s partition (they wait behind it)."""
    return [r for r in records if (r.topic, r.partition) != (of.topic, of.partition)]


def _mark(d: Decoded) -> Mark:
    return Mark(d.message_id, d.record.topic, d.record.partition, d.record.offset)


def _marks(decoded: list[Decoded]) -> Marks:
    """The batch's marks as columns (no Mark object per message)."""
    records = [d.record for d in decoded]
    return Marks(
        [d.message_id for d in decoded],
        [r.topic for r in records],
        [r.partition for r in records],
        [r.offset for r in records],
    )

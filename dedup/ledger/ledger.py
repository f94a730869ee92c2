"""The operations ledger with its settings (and default policy) bound once: :class:`Ledger`.

Methods that take a ``Connection`` / ``Session`` run in the caller's transaction and
**never commit**; the ones that take an ``Engine`` (:meth:`Ledger.perform`, the reconcile
passes, :meth:`Ledger.purge`) run short transactions of their own, as the ledger's
crash-safety needs (the intent is committed before the outside call).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from sqlalchemy import Engine

from dedup.ledger import operations, perform, reconcile, resolution, retention
from dedup.ledger import scheduler as jobs
from dedup.ledger.operations import Intent, OnSettle, Operation, OperationEvent, OperationStatus
from dedup.ledger.outcomes import Applied, Evidence, Found, Refused
from dedup.ledger.policy import ReconcilePolicy
from dedup.ledger.reconcile import DEFAULT_POLICY, ReconcileReport
from dedup.ledger.retention import DEFAULT_BATCH, DEFAULT_DEDUP_WINDOW_SECONDS, OperationsPurge
from dedup.ledger.systems import System
from outbox.db.execution import SyncConn
from outbox.settings import OutboxSettings, default_settings

Statuses = OperationStatus | str | Collection[OperationStatus | str] | None


class Ledger:
    """Outside operations recorded before they are called, settled with evidence after.

    *settings*: the schema the ledger's tables are in (default: from the environment).
    *policy*: how hard the reconciler tries (:class:`ReconcilePolicy`); every method that
    takes ``policy=`` uses this one unless given another. Give the consumer and the
    reconciler the same ledger, or at least the same policy (see docs/operations.md).
    """

    def __init__(self, *, settings: OutboxSettings | None = None,
                 policy: ReconcilePolicy | None = None) -> None:
        self._settings = settings
        self.policy = policy or DEFAULT_POLICY

    @property
    def settings(self) -> OutboxSettings:
        """The settings every query of this ledger uses (default: from the environment)."""
        return self._settings or default_settings()

    # -- the call ---------------------------------------------------------------------------

    @staticmethod
    def idempotency_key(message_id: uuid.UUID | str, operation: str) -> str:
        """The key :meth:`perform` derives from a message id: ``"<operation>:<message id>"``,
        the same on every redelivery."""
        return operations.idempotency_key(message_id, operation)

    def perform(self, engine: Engine, *, system: System, operation: str, request: Any,
                message_id: uuid.UUID | str | None = None, key: str | None = None,
                run_id: uuid.UUID | None = None, on_settle: OnSettle | str = OnSettle.FINISH,
                policy: ReconcilePolicy | None = None, actor: str = "perform") -> Operation:
        """Do *operation* on *system* at most once per key; return the operation as recorded.

        Intent, call and outcome, each in a transaction of its own on *engine*. The key is
        *key*, or :meth:`idempotency_key` of *message_id* and *operation*; a settled
        operation is returned as it is, an open one that is due is reconciled. With *run_id*
        the waiting run is settled with the operation, as *on_settle* says (``"finish"`` or
        ``"resume"``). Raises :class:`~dedup.ledger.RequestMismatch` (writing nothing) when
        the key was recorded for another request.
        """
        return perform.perform(
            engine, system=system, operation=operation, request=request,
            message_id=message_id, key=key, run_id=run_id, on_settle=on_settle,
            policy=policy or self.policy, actor=actor, settings=self._settings)

    def begin(self, conn: SyncConn, *, key: str, system: str, operation: str, request: Any,
              run_id: uuid.UUID | None = None, message_id: uuid.UUID | str | None = None,
              in_flight_grace: float | None = None, store_request: bool = True,
              actor: str = "ledger", on_settle: OnSettle | str = OnSettle.FINISH) -> Intent:
        """Record the intent to call *system* with *key*, or find the one already recorded.

        Never commits, and the caller **must commit before calling**. ``Intent.created``
        says whether to call now. *in_flight_grace* (default: the policy's): seconds during
        which the pending call belongs to this process.
        """
        grace = self.policy.in_flight_grace if in_flight_grace is None else in_flight_grace
        return operations.begin(
            conn, key=key, system=system, operation=operation, request=request, run_id=run_id,
            message_id=message_id, in_flight_grace=grace, store_request=store_request,
            actor=actor, on_settle=on_settle, settings=self._settings)

    def record_outcome(self, conn: SyncConn, operation_id: uuid.UUID,
                       outcome: Applied | Refused | Found, *, actor: str = "ledger",
                       kind: str = "call") -> Operation:
        """Record a definite answer, ``confirmed`` or ``rejected``; settles the waiting run in
        the same transaction. Never commits."""
        return operations.record_outcome(conn, operation_id, outcome, actor=actor, kind=kind,
                                         settings=self._settings)

    def mark_unknown(self, conn: SyncConn, operation_id: uuid.UUID, *, reason: str,
                     check_in: float = 0.0, actor: str = "ledger") -> Operation:
        """Record that the call's outcome was not seen; a status query is due in *check_in*
        seconds. Never commits."""
        return operations.mark_unknown(conn, operation_id, reason=reason, check_in=check_in,
                                       actor=actor, settings=self._settings)

    # -- reading ----------------------------------------------------------------------------

    def get_operation(self, conn: SyncConn, operation_id: uuid.UUID | None = None, *,
                      key: str | None = None) -> Operation:
        """The operation with this id or idempotency key
        (:class:`~dedup.ledger.OperationNotFound` if none)."""
        return operations.get_operation(conn, operation_id, key=key, settings=self._settings)

    def history(self, conn: SyncConn, operation_id: uuid.UUID) -> list[OperationEvent]:
        """Every event of the operation, oldest first: how its status was reached."""
        return operations.operation_history(conn, operation_id, settings=self._settings)

    def list_operations(self, conn: SyncConn, *, status: Statuses = None,
                        system: str | None = None, run_id: uuid.UUID | None = None,
                        limit: int = 100) -> list[Operation]:
        """Operations, newest first, filtered by status (one or several), system and run."""
        return resolution.list_operations(conn, status=status, system=system, run_id=run_id,
                                          limit=limit, settings=self._settings)

    def count_operations(self, conn: SyncConn, *, status: Statuses = None,
                         system: str | None = None, run_id: uuid.UUID | None = None) -> int:
        """How many operations :meth:`list_operations` would list without a limit."""
        return resolution.count_operations(conn, status=status, system=system, run_id=run_id,
                                           settings=self._settings)

    # -- reconciling ------------------------------------------------------------------------

    def reconcile_due(self, engine: Engine, systems: Mapping[str, System] | Iterable[System],
                      *, policy: ReconcilePolicy | None = None, actor: str = "reconciler",
                      limit: int = 10) -> ReconcileReport:
        """One reconciliation pass over due operations of *systems* (the job's body); safe
        in many processes at once."""
        return reconcile.reconcile_due(engine, systems, policy=policy or self.policy,
                                       actor=actor, limit=limit, settings=self._settings)

    def reconcile_operation(self, engine: Engine, operation_id: uuid.UUID, system: System, *,
                            policy: ReconcilePolicy | None = None, actor: str = "reconciler",
                            due_only: bool = True) -> Operation:
        """Settle one operation now if it is open (and due, unless ``due_only=False``)."""
        return reconcile.reconcile_operation(
            engine, operation_id, system, policy=policy or self.policy, actor=actor,
            due_only=due_only, settings=self._settings)

    def add_reconcile_job(self, scheduler: Any, engine: Engine,
                          systems: Mapping[str, System] | Iterable[System], *,
                          interval_seconds: float = 5.0, policy: ReconcilePolicy | None = None,
                          actor: str = "reconciler", limit: int = 10) -> Any:
        """Add :meth:`reconcile_due` to an APScheduler 3 scheduler (``max_instances=1``);
        return the job."""
        return jobs.add_reconcile_job(
            scheduler, engine, systems, interval_seconds=interval_seconds,
            policy=policy or self.policy, actor=actor, limit=limit, settings=self._settings)

    # -- a person's decision ----------------------------------------------------------------

    def resolve_confirmed(self, conn: SyncConn, operation_id: uuid.UUID, *,
                          evidence: Evidence, actor: str, reason: str) -> Operation:
        """A person confirms the operation was applied, with the evidence they found; its
        run is settled with it. Never commits."""
        return resolution.resolve_confirmed(conn, operation_id, evidence=evidence, actor=actor,
                                            reason=reason, settings=self._settings)

    def resolve_not_applied(self, conn: SyncConn, operation_id: uuid.UUID, *, actor: str,
                            reason: str, evidence: Evidence | None = None) -> Operation:
        """A person establishes the operation was **not** applied: the next reconcile pass
        calls again with the same key. Never commits."""
        return resolution.resolve_not_applied(conn, operation_id, actor=actor, reason=reason,
                                              evidence=evidence, settings=self._settings)

    # -- retention --------------------------------------------------------------------------

    def purge(self, engine: Engine, older_than_seconds: float, *, batch: int = DEFAULT_BATCH,
              dedup_window_seconds: float | None = DEFAULT_DEDUP_WINDOW_SECONDS,
              max_batches: int = 1000, dry_run: bool = False,
              on_batch: Callable[[OperationsPurge], object] | None = None) -> int:
        """Delete settled operations (and their events) settled over *older_than_seconds*
        ago, one committed batch at a time; return how many went (would go, ``dry_run``).

        A window shorter than *dedup_window_seconds* (the consumers' longest dedup window)
        is refused before anything is deleted.
        """
        return retention.purge_operations(
            engine, older_than_seconds, batch=batch, dedup_window_seconds=dedup_window_seconds,
            max_batches=max_batches, dry_run=dry_run, settings=self._settings,
            on_batch=on_batch)

    def count_purgeable(self, conn: SyncConn, older_than_seconds: float, *,
                        dedup_window_seconds: float | None = DEFAULT_DEDUP_WINDOW_SECONDS,
                        ) -> OperationsPurge:
        """What :meth:`purge` would delete now; reads only."""
        return retention.count_purgeable_operations(
            conn, older_than_seconds, dedup_window_seconds=dedup_window_seconds,
            settings=self._settings)

    def add_retention_job(self, scheduler: Any, engine: Engine, *, older_than_seconds: float,
                          dedup_window_seconds: float | None = DEFAULT_DEDUP_WINDOW_SECONDS,
                          interval_seconds: float = 3600.0, batch: int = DEFAULT_BATCH,
                          max_batches: int = 1000) -> Any:
        """Add :meth:`purge` to an APScheduler 3 scheduler, hourly by default; the window is
        checked now, so a bad one fails at start-up. Returns the job."""
        return jobs.add_operations_retention_job(
            scheduler, engine, older_than_seconds=older_than_seconds,
            dedup_window_seconds=dedup_window_seconds, interval_seconds=interval_seconds,
            batch=batch, max_batches=max_batches, settings=self._settings)

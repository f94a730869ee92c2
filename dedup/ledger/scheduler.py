"""Wiring :func:`dedup.ledger.reconcile.reconcile_due` and
:func:`dedup.ledger.retention.purge_operations` into an APScheduler scheduler
(:meth:`dedup.ledger.Ledger.add_reconcile_job`, :meth:`~dedup.ledger.Ledger.add_retention_job`).

The job bodies stay plain functions (testable by calling them); only this module knows about
APScheduler. ``max_instances=1`` keeps one pass at a time in a process; across processes
the SKIP LOCKED claims keep two passes off the same operation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Engine

from dedup.ledger.policy import ReconcilePolicy
from dedup.ledger.reconcile import DEFAULT_POLICY, reconcile_due
from dedup.ledger.retention import (
    DEFAULT_BATCH,
    DEFAULT_DEDUP_WINDOW_SECONDS,
    OperationsPurge,
    check_retention_window,
    purge_operations,
)
from dedup.ledger.systems import System
from outbox.errors import ConfigurationError
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
JOB_ID = "dedup-reconcile"
RETENTION_JOB_ID = "dedup-operations-retention"


def add_reconcile_job(
    scheduler: Any,
    engine: Engine,
    systems: Mapping[str, System] | Iterable[System],
    *,
    interval_seconds: float = 5.0,
    policy: ReconcilePolicy = DEFAULT_POLICY,
    actor: str = "reconciler",
    limit: int = 10,
    settings: OutboxSettings | None = None,
) -> Any:
    """Add the reconcile pass to *scheduler* (an APScheduler 3 scheduler); return the job."""
    known = list(systems.values()) if isinstance(systems, Mapping) else list(systems)

    def reconcile_job() -> None:
        try:
            report = reconcile_due(engine, known, policy=policy, actor=actor, limit=limit,
                                   settings=settings)
        except Exception:
            # A database outage must not kill the schedule: the next pass retries.
            log.exception("reconcile pass failed", extra={"event": "dedup.reconcile_pass_failed"})
            return
        if report.claimed:
            log.info("reconciled %d operations: %s", report.claimed, report.statuses,
                     extra={"event": "dedup.reconcile_pass"})

    return scheduler.add_job(
        reconcile_job, "interval", seconds=interval_seconds, id=JOB_ID, replace_existing=True,
        max_instances=1, coalesce=True, misfire_grace_time=None,
    )


def add_operations_retention_job(
    scheduler: Any,
    engine: Engine,
    *,
    older_than_seconds: float,
    dedup_window_seconds: float | None = DEFAULT_DEDUP_WINDOW_SECONDS,
    interval_seconds: float = 3600.0,
    batch: int = DEFAULT_BATCH,
    max_batches: int = 1000,
    settings: OutboxSettings | None = None,
) -> Any:
    """Add the operations retention pass (:func:`dedup.ledger.retention.purge_operations`) to
    *scheduler*; return the job.

    The window is checked here, when the job is added, so a window shorter than the dedup
    window fails at start-up with a :class:`ConfigurationError` instead of in a log an hour
    later. Hourly by default: retention is measured in days, and each pass is short batches.
    """
    check_retention_window(older_than_seconds, dedup_window_seconds)
    if batch <= 0 or max_batches <= 0 or interval_seconds <= 0:
        raise ConfigurationError("batch, max_batches and interval_seconds must be > 0")

    def operations_retention_job() -> None:
        deleted: list[OperationsPurge] = []
        try:
            purge_operations(engine, older_than_seconds, batch=batch, max_batches=max_batches,
                             dedup_window_seconds=dedup_window_seconds, settings=settings,
                             on_batch=deleted.append)
        except Exception:
            # A database outage must not kill the schedule: the next pass retries.
            log.exception("operations retention pass failed",
                          extra={"event": "dedup.operations_retention_failed"})
            return
        operations = sum(d.operations for d in deleted)
        if operations:
            log.info("purged %d settled operations and %d events", operations,
                     sum(d.events for d in deleted),
                     extra={"event": "dedup.operations_retention_pass"})

    return scheduler.add_job(
        operations_retention_job, "interval", seconds=interval_seconds, id=RETENTION_JOB_ID,
        replace_existing=True, max_instances=1, coalesce=True, misfire_grace_time=None,
    )

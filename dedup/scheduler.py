"""Wiring :func:`dedup.reconcile.reconcile_due` into an APScheduler scheduler.

The job body stays a plain function (testable by calling it); only this module knows about
APScheduler. ``max_instances=1`` keeps one pass at a time in a process; across processes
the SKIP LOCKED claims keep two passes off the same operation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Engine

from dedup.policy import ReconcilePolicy
from dedup.reconcile import DEFAULT_POLICY, reconcile_due
from dedup.systems import System
from outbox.settings import OutboxSettings

log = logging.getLogger(__name__)
JOB_ID = "dedup-reconcile"


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

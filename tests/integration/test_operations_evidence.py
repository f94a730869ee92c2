"""An operation checked 200 times against a 1 MB error page escalates with evidence a human
can read: bounded in size, naming what it left out, with digests of what it cut."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import Engine

from dedup.ledger import Ledger, Operation, OperationStatus, StatusOutcome, System, Unclear
from dedup.ledger.outcomes import canonical_digest
from outbox.runs.lifecycle import history as run_history
from tests.integration.operations_support import fast_policy, history, reload, waiting_run

LEDGER = Ledger()

CHECKS = 200
PAGE = "<html>" + "x" * 1_000_000 + "</html>"  # a 1 MB error page from a proxy


def size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))


def test_two_hundred_unclear_answers_with_1_mb_bodies_escalate_with_bounded_evidence(
    engine: Engine
) -> None:
    def call(_: Operation) -> Unclear:
        return Unclear(f"HTTP 502: {PAGE}")

    def status_query(_: Operation) -> StatusOutcome:
        return Unclear(f"status query answered HTTP 503: {PAGE}")

    system = System(name="supplier", call=call, status_query=status_query)
    policy = fast_policy(max_checks=CHECKS, max_age_seconds=None)
    run_id = waiting_run(engine)
    op = LEDGER.perform(engine, system=system, operation="place-order", request={"qty": 3},
                        message_id="m-1", run_id=run_id, policy=policy)
    for _ in range(CHECKS):
        op = LEDGER.reconcile_operation(engine, op.id, system, policy=policy, due_only=False)
    assert op.status is OperationStatus.NEEDS_HUMAN

    escalated = reload(engine, op)
    evidence = escalated.evidence
    limit, keep = policy.evidence_max_value_bytes, policy.evidence_last_events
    # ~200 MB of answers in; out: intent + first call + the last `keep`, a few KiB each
    assert size(evidence) < (keep + 2) * (limit + 512) + 4096
    assert size(evidence) < 150_000
    assert evidence["checks"] == CHECKS
    assert evidence["events_total"] == CHECKS + 2  # intent, first call, the checks
    assert evidence["events_elided"] == CHECKS - keep

    events = history(engine, op)
    intent, first_call, gap, *last = evidence["events"]
    assert (intent["kind"], first_call["kind"]) == ("intent", "call")
    assert gap["elided"] == CHECKS - keep
    assert gap["kinds"] == {"check/unclear": CHECKS - keep}
    elided = [e.as_json() for e in events[2:2 + CHECKS - keep]]
    assert gap["digest"] == canonical_digest(elided)  # provable from operation_history()
    assert [e["detail"]["check"] for e in last] == list(range(CHECKS - keep + 1, CHECKS + 1))

    # The first call's 1 MB answer is cut, with its full size and sha256.
    first = f"HTTP 502: {PAGE}"
    reason = first_call["detail"]["reason"]
    assert reason.startswith("HTTP 502: <html>xxx")
    assert len(reason.encode()) <= limit
    assert f"{len(first)} bytes in all, sha256:{hashlib.sha256(first.encode()).hexdigest()}" \
        in reason

    # Each check was recorded clipped, so the ledger itself did not take 200 MB either...
    checks = [e for e in events if e.kind == "check"]
    assert len(checks) == CHECKS
    assert max(size(e.detail) for e in checks) < limit + 64
    # ...nor the escalation's reason, last_error, or the run's needs-human transition.
    assert len((escalated.last_error or "").encode()) < limit + 200
    with engine.connect() as conn:
        moved = run_history(conn, run_id)[-1]
    assert moved.to_state == "needs-human"
    assert size(moved.evidence) < size(evidence) + 1024
    assert len((moved.reason or "").encode()) < limit + 400

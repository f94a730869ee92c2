"""The operations ledger's pure parts: digests, keys, the policy, and reading answers."""

from __future__ import annotations

import math
import random
import uuid
from datetime import UTC, datetime

import pytest

import dedup.ledger
from dedup.ledger import (
    Applied,
    Evidence,
    Found,
    Ledger,
    NotFound,
    Operation,
    OperationStatus,
    ReconcilePolicy,
    Refused,
    System,
    Unclear,
)
from dedup.ledger.outcomes import canonical_digest
from dedup.ledger.systems import ask, invoke
from outbox.errors import ConfigurationError

LEDGER = Ledger()

OPERATIONS_API = {
    "Applied", "CallOutcome", "Evidence", "Found", "Intent", "NotFound", "Operation",
    "OperationError", "OperationEvent", "OperationNotFound", "OperationStatus",
    "ReconcilePolicy", "ReconcileReport", "Refused", "RequestMismatch", "ResolutionRefused",
    "StatusOutcome", "System", "Unclear", "OnSettle", "Ledger",
}
# The operations, each a method of the Ledger (settings bound once).
LEDGER_METHODS = {
    "add_reconcile_job", "begin", "get_operation", "idempotency_key", "list_operations",
    "mark_unknown", "history", "perform", "reconcile_due", "reconcile_operation",
    "record_outcome", "resolve_confirmed", "resolve_not_applied", "count_operations",
}


def _operation() -> Operation:
    now = datetime.now(UTC)
    return Operation(
        id=uuid.uuid4(), idempotency_key="place-order:m-1", system="supplier",
        operation="place-order", message_id="m-1", run_id=None, request_digest="sha256:x",
        request={"qty": 3}, status=OperationStatus.PENDING, calls=1, checks=0, version=1,
        reference=None, response_digest=None, evidence=None, last_error=None,
        next_check_at=None, resolved_by=None, resolution_reason=None, created_at=now,
        updated_at=now, resolved_at=None,
    )


class TestPublicSurface:
    def test_dedup_exports_the_operations_api_sorted_and_importable(self) -> None:
        assert set(dedup.ledger.__all__) >= OPERATIONS_API
        assert dedup.ledger.__all__ == sorted(dedup.ledger.__all__)
        assert all(hasattr(dedup.ledger, name) for name in OPERATIONS_API)
        assert all(callable(getattr(Ledger, name)) for name in LEDGER_METHODS)


class TestDigestsAndKeys:
    def test_the_request_digest_ignores_key_order_but_not_values(self) -> None:
        assert canonical_digest({"a": 1, "b": [1, 2]}) == canonical_digest({"b": [1, 2], "a": 1})
        assert canonical_digest({"a": 1}) != canonical_digest({"a": 2})
        assert canonical_digest({"a": 1}).startswith("sha256:")

    def test_a_request_that_is_not_json_is_refused_with_a_reason(self) -> None:
        with pytest.raises(ConfigurationError, match="must be JSON"):
            canonical_digest({"when": datetime.now(UTC)})
        with pytest.raises(ConfigurationError, match="must be JSON"):
            canonical_digest({"x": math.nan})

    def test_the_key_is_stable_per_message_and_differs_per_operation(self) -> None:
        message = uuid.uuid4()
        key = LEDGER.idempotency_key
        assert key(message, "place-order") == key(str(message), "place-order")
        assert key(message, "place-order") != key(message, "notify")
        with pytest.raises(ConfigurationError):
            LEDGER.idempotency_key(message, "")


class TestPolicy:
    def test_backoff_grows_and_is_capped(self) -> None:
        policy = ReconcilePolicy(initial_backoff=1, multiplier=2, max_backoff=5, jitter=0)
        assert [policy.backoff(n) for n in range(5)] == [1, 1, 2, 4, 5]

    def test_an_initial_backoff_over_the_max_is_refused_naming_both(self) -> None:
        # Regression (issue #13): initial_backoff=30, max_backoff=10 was capped to 10 silently.
        with pytest.raises(ConfigurationError) as caught:
            ReconcilePolicy(initial_backoff=30, max_backoff=10)
        assert "initial_backoff (30 s)" in str(caught.value)
        assert "max_backoff (10 s)" in str(caught.value)
        assert ReconcilePolicy(initial_backoff=10, max_backoff=10).backoff(1) <= 10

    def test_jitter_only_shortens_the_delay(self) -> None:
        policy = ReconcilePolicy(initial_backoff=10, jitter=0.5)
        delays = [policy.backoff(1, random.Random(seed)) for seed in range(20)]
        assert all(5 <= d <= 10 for d in delays)

    @pytest.mark.parametrize("bad", [
        {"max_checks": 0}, {"max_calls": 0}, {"max_age_seconds": 0}, {"multiplier": 0.5},
        {"jitter": 2}, {"claim_seconds": 0},
    ])
    def test_nonsense_bounds_are_refused(self, bad: dict[str, float]) -> None:
        with pytest.raises(ConfigurationError):
            ReconcilePolicy(**bad)  # type: ignore[arg-type]


class TestReadingAnswers:
    def test_an_exception_from_the_call_is_unclear_never_a_failure(self) -> None:
        def boom(_: Operation) -> Applied:
            raise TimeoutError("read timed out")

        system = System("s", call=boom, status_query=lambda _: NotFound())
        outcome = invoke(system, _operation())
        assert outcome == Unclear("TimeoutError: read timed out")

    def test_an_answer_of_the_wrong_type_is_unclear(self) -> None:
        system = System("s", call=lambda _: None,  # type: ignore[arg-type,return-value]
                        status_query=lambda _: Applied(Evidence()))  # type: ignore[arg-type,return-value]
        assert isinstance(invoke(system, _operation()), Unclear)
        assert isinstance(ask(system, _operation()), Unclear)

    def test_definite_answers_pass_through(self) -> None:
        evidence = Evidence.of_response({"order_id": "ORD-1"}, reference="ORD-1")
        system = System("s", call=lambda _: Refused(evidence),
                        status_query=lambda _: Found(evidence))
        assert invoke(system, _operation()) == Refused(evidence)
        assert ask(system, _operation()) == Found(evidence)
        assert evidence.as_json()["reference"] == "ORD-1"
        assert not evidence.is_empty()
        assert Evidence().is_empty()

"""Errors of the operations ledger, a branch of outboxkit's one error tree::

    OutboxError
    └── OperationError              the ledger of outside operations refused something
        ├── RequestMismatch         an idempotency key was reused for a different request
        ├── OperationNotFound       no operation has this id / key
        └── ResolutionRefused       a human resolution does not apply to the operation's status

Outcomes of outside calls (applied, refused, unclear) are values, not errors: see
:mod:`dedup.ledger.outcomes`.
"""

from __future__ import annotations

from uuid import UUID

from outbox.errors import OutboxError


class OperationError(OutboxError):
    """Base of the operations-ledger errors."""


class RequestMismatch(OperationError):
    """The idempotency key is already recorded for a different request; nothing was written.

    Reusing a key for another request would make the outside system return the first
    request's result for the second one. Derive keys from the message id *and* the
    operation name (:func:`dedup.ledger.operations.idempotency_key`).
    """

    def __init__(self, key: str, stored: str, given: str, what: str = "request digest") -> None:
        super().__init__(
            f"idempotency key {key!r} was already used with {what} {stored}, not {given}: the key "
            "was reused for a different request; derive a key per message and operation "
            "(dedup.idempotency_key). Nothing was written."
        )
        self.key, self.stored, self.given, self.what = key, stored, given, what


class OperationNotFound(OperationError):
    """No operation has this id or key (or its intent was never committed)."""

    def __init__(self, ref: UUID | str) -> None:
        super().__init__(f"no operation {ref}: check the id (was its intent committed?)")
        self.ref = ref


class ResolutionRefused(OperationError):
    """A human resolution was refused: the operation is already settled (or the input is
    incomplete). Nothing was written."""

    def __init__(self, operation_id: UUID, status: str, detail: str) -> None:
        super().__init__(
            f"operation {operation_id} (status {status!r}) cannot be resolved: {detail}; "
            "nothing was written"
        )
        self.operation_id, self.status, self.detail = operation_id, status, detail

"""The lease a worker holds on a run: the fencing token every write is checked against."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Lease:
    """Proof that this worker owns *run_id* right now.

    ``token`` grows on every claim of the run, ``version`` on every write to it. A write
    succeeds only while both still match the row, checked in the same SQL statement; a
    worker whose lease was taken over gets :class:`outbox.errors.LeaseLost` and wrote nothing.
    Writes return a new ``Lease`` with the bumped version: keep using the latest one.
    """

    run_id: uuid.UUID
    owner: str
    token: int
    version: int
    expires_at: datetime
